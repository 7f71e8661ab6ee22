"""Pods: host specs, SSH connection, probe, sync, remote runs and log fetch. Moves things; computes nothing."""
