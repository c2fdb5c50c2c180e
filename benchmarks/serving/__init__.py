"""Serving benchmarks: ridge serve under load."""
