"""Perplexity of a model on text files, computed by ridge's own engine (prompt log-probabilities),
so that every precision or decoding option can report its quality cost on the same footing.

The text is scored the way the demo model was trained and evaluated: each file becomes
BOS + tokens + EOS, the files are concatenated into one stream, and the stream is cut into
non-overlapping windows of seq_len + 1 tokens; each window's last seq_len tokens are scored
given the tokens before them in the window. Targets that are BOS are not scored.

`compare` scores the same windows with a second model (e.g. the bf16 checkpoint a quantized one
came from) and reports the KL divergence KL(reference || model) of the next-token distributions,
mean over the scored positions: perplexity only sees the probability of the token that came next,
while KL sees every token's, so it shows a precision's cost where perplexity moves too little to
tell. The full distributions are never stored (vocab x tokens would not fit): each window is run
through both engines in turn and reduced to its KL sum at once.
"""
from __future__ import annotations

import functools
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


def check_files(paths: list[str]) -> None:
    """Every path a readable file (ValueError naming the first that is not): checked before a
    model loads."""
    if not paths:
        raise ValueError("files: no files to evaluate")
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"files: {path!r} {'is a directory' if os.path.isdir(path) else 'does not exist'}")
        if not os.access(path, os.R_OK):
            raise ValueError(f"files: {path!r} is not readable")


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


def scoring_windows(llm, paths: list[str], seq_len: int) -> list[list[int]]:
    if not paths:
        raise ValueError("files: no files to evaluate")
    if llm.tokenizer is None:
        raise ValueError("model: perplexity on text needs a tokenizer")
    stream = token_stream(llm.tokenizer, paths)
    windows = [stream[s:s + seq_len + 1] for s in range(0, (len(stream) - 1) // seq_len * seq_len, seq_len)]
    if not windows:
        raise ValueError(f"files: fewer than {seq_len + 1} tokens in all")
    return windows


def _scoring_params():
    from ridge import SamplingParams

    # prompt_logprobs also keeps the window off the prefix cache: every position is computed
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)


def token_logprobs(out) -> list[float]:
    """log p of each prompt token after the first given the tokens before it, from an output of
    a request made with `_scoring_params`."""
    return [entry[tok].logprob for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def score(llm, windows: list[list[int]], use_tqdm: bool = False) -> list[list[float]]:
    """Each window's token_logprobs: how eval-ppl scores text, for any token windows."""
    from tqdm.auto import tqdm

    bar = functools.partial(tqdm, desc="scoring", unit="window") if use_tqdm else False
    return [token_logprobs(out) for out in llm.generate(windows, _scoring_params(), use_tqdm=bar)]


def perplexity(llm, paths: list[str], seq_len: int = 512, use_tqdm: bool = True) -> PerplexityResult:
    windows = scoring_windows(llm, paths, seq_len)
    bos = llm.tokenizer.bos_token_id
    nll, count = 0.0, 0
    for window, lps in zip(windows, score(llm, windows, use_tqdm)):
        for tok, lp in zip(window[1:], lps):
            if tok != bos:
                nll -= lp
                count += 1
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(paths), len(windows))


@dataclass
class CompareResult:
    perplexity: float               # the model's, on these windows
    nll_per_token: float
    reference_perplexity: float     # the reference model's, on the same windows
    kl_divergence: float            # mean over scored positions of KL(reference || model), nats
    top1_agreement: float           # fraction of positions where both models' most likely token agree
    tokens: int
    files: int
    windows: int


def _next_token_logprobs(llm, window: list[int]):
    """(engine's log p of each next token, [len - 1, vocab] float32 log-distributions) for one
    window, the distributions computed from the hidden states of the engine's own forward pass
    (caught on their way out of the model, ordered by position: a chunked prefill's pieces too)."""
    import torch

    model, caught = llm.engine.runner.model, []

    def catch(module, args, hidden):             # args: input ids, positions, caches, metadata
        caught.append((args[1].clone(), hidden.clone()))
    handle = model.register_forward_hook(catch)
    try:
        out = llm.generate([window], _scoring_params(), use_tqdm=False)[0]
    finally:
        handle.remove()
    positions = torch.cat([p for p, _ in caught]).long()
    hidden = torch.cat([h for _, h in caught])[positions.argsort()][:len(window) - 1]
    if positions.numel() < len(window) - 1:
        raise RuntimeError("compare: the engine computed fewer positions than the window has")
    with torch.inference_mode():
        return token_logprobs(out), torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def compare(llm, reference, paths: list[str], seq_len: int = 512, use_tqdm: bool = True) -> CompareResult:
    """Perplexity of `llm` and `reference` on the same windows, and the KL divergence between
    their next-token distributions (module docstring)."""
    import torch
    from tqdm.auto import tqdm

    if reference.tokenizer is None or llm.tokenizer.get_vocab() != reference.tokenizer.get_vocab():
        raise ValueError("compare: the two models' tokenizers differ; KL needs the same vocabulary")
    windows = scoring_windows(llm, paths, seq_len)       # checks llm has a tokenizer
    bos = llm.tokenizer.bos_token_id
    nll, ref_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    for window in tqdm(windows, desc="comparing", unit="window", disable=not use_tqdm):
        lps, logp = _next_token_logprobs(llm, window)
        ref_lps, ref_logp = _next_token_logprobs(reference, window)
        if logp.shape != ref_logp.shape:
            raise ValueError(f"compare: vocabularies differ ({logp.shape[-1]} vs {ref_logp.shape[-1]} tokens)")
        keep = torch.tensor([t != bos for t in window[1:]], device=logp.device)
        logp, ref_logp = logp[keep], ref_logp.to(logp.device)[keep]     # on the device: no [rows, vocab] copies
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        scored = [(a, b) for t, a, b in zip(window[1:], lps, ref_lps) if t != bos]
        nll -= sum(a for a, _ in scored)
        ref_nll -= sum(b for _, b in scored)
        count += len(scored)
    return CompareResult(math.exp(nll / count), nll / count, math.exp(ref_nll / count), kl / count, agree / count,
                         count, len(paths), len(windows))
