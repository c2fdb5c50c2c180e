"""Helpers shared by test modules."""
import torch

from ridge.layers.sampler import SamplingBatch


def single_row_batch(params, step: int, vocab: int, device) -> SamplingBatch:
    """The SamplingBatch ridge builds for sample 0 of a request with these params at `step`."""
    def t(v, dtype=torch.float32):
        return torch.tensor([v], dtype=dtype, device=device)
    return SamplingBatch(temperature=t(params.temperature), top_k=t(params.top_k if params.top_k > 0 else vocab, torch.int64),
                         top_p=t(params.top_p), min_p=t(params.min_p), seeds=t(params.seed, torch.int64),
                         steps=t(step, torch.int64), presence_penalty=t(0.0), frequency_penalty=t(0.0),
                         repetition_penalty=t(1.0), output_counts=None, seen_mask=None, banned=None, max_logprobs=-1)
