"""Tests that run whole programs together: daemons, clusters, installs, the emulated WAN."""
