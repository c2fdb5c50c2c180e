"""Engine benchmarks: decode steps, speculation, tensor parallelism, engine start-up, the A/B against a baseline tree."""
