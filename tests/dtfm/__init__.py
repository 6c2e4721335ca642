"""Tests of dtfm."""
