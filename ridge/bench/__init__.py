"""Benchmarks run through the ridge CLI: `ridge bench latency | throughput | serve`."""
