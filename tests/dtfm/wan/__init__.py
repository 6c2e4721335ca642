"""Tests of dtfm/wan."""
