"""Speculative decoding's proposers: the interface (proposer.py) and n-gram prompt lookup (ngram.py).
The draft-model proposer runs a second model through the engine's runner and page allocator
(ridge/engine/draft_model.py); verification is sampling, so it lives beside the sampler
(ridge/layers/spec_sampling.py); the engine's side is ridge/engine/speculation.py."""
