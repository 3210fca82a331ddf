"""Workloads: trace loaders, synthetic generators and load scaling."""
