"""Tests of coordinator/scheduler."""
