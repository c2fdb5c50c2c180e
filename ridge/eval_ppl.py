"""Perplexity of a model on text files, computed by ridge's own engine (prompt log-probabilities),
so that every precision or decoding option can report its quality cost on the same footing.

The text is scored the way the demo model was trained and evaluated: each file becomes
BOS + tokens + EOS, the files are concatenated into one stream, and the stream is cut into
non-overlapping windows of seq_len + 1 tokens; each window's last seq_len tokens are scored
given the tokens before them in the window. Targets that are BOS are not scored.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass


@dataclass
class PerplexityResult:
    perplexity: float
    nll_per_token: float
    tokens: int
    files: int
    windows: int


def heldout_files(model_dir: str) -> list[str]:
    """The held-out stdlib files named in the checkpoint's heldout_files.txt that exist in this
    Python's standard library."""
    listing = os.path.join(model_dir, "heldout_files.txt")
    if not os.path.isfile(listing):
        raise ValueError(f"files: {model_dir!r} has no heldout_files.txt; pass --files")
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = [os.path.join(stdlib, rel) for rel in open(listing).read().split()]
    return [p for p in paths if os.path.isfile(p)]


def token_stream(tokenizer, paths: list[str]) -> list[int]:
    stream = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            ids = list(tokenizer(f.read())["input_ids"])
        if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
            ids.insert(0, tokenizer.bos_token_id)
        stream += ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return stream


def perplexity(llm, paths: list[str], seq_len: int = 512, use_tqdm: bool = True) -> PerplexityResult:
    from ridge import SamplingParams

    if not paths:
        raise ValueError("files: no files to evaluate")
    if llm.tokenizer is None:
        raise ValueError("model: perplexity on text needs a tokenizer")
    stream = token_stream(llm.tokenizer, paths)
    windows = [stream[s:s + seq_len + 1] for s in range(0, (len(stream) - 1) // seq_len * seq_len, seq_len)]
    if not windows:
        raise ValueError(f"files: fewer than {seq_len + 1} tokens in all")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True, ignore_eos=True)
    outs = llm.generate(windows, params, use_tqdm=use_tqdm)
    bos = llm.tokenizer.bos_token_id
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for tok, lp in zip(window[1:], out.prompt_logprobs[1:]):
            if tok != bos:
                nll -= lp
                count += 1
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(paths), len(windows))
