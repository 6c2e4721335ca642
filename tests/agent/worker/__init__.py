"""Tests of agent/worker."""
