"""Speculative decoding: proposers (n-gram prompt lookup; the draft model comes with the engine
wiring). Verification is sampling, so it lives beside the sampler: ridge/layers/spec_sampling.py."""
