"""Kernel benchmarks: each kernel against its peer, timed by benchmarks/timing.py."""
