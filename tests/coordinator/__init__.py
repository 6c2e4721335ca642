"""Tests of coordinator."""
