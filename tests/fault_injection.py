"""Faults injected into an engine's step by patching its runner or tokenizer (no switch inside
ridge/): for the engine's fault tests (tests/engine/test_step_faults.py) and the server's."""
from __future__ import annotations

import torch

DEVICE_LOST = "CUDA error: an illegal memory access was encountered"
FAULTS = ["kernel error", "out of memory in a prefill", "non-finite logits", "tokenizer error on detokenize"]


def fail_runner(monkeypatch, engine, at: int, error: Exception | None = None, poison: bool = False) -> list:
    """The runner's forward (`run`, every step's, the overlapped ones' too) raises `error` at its
    `at`-th call from now, or with `poison` returns that call's logits with a NaN in row 0;
    the other calls run as they would. Returns the list of calls made."""
    runner, calls = engine.runner, []
    run = runner.run

    def faulty(plan, previous=None):
        calls.append(1)
        if len(calls) == at and error is not None:
            raise error
        out = run(plan, previous)
        if len(calls) == at and poison:
            with torch.inference_mode():
                out.logits[0, 3] = float("nan")
        return out

    monkeypatch.setattr(runner, "run", faulty)
    return calls


class BrokenTokenizer:
    """The tokenizer, whose detokenizing fails at its `at`-th use (the tokenizers library raises a
    bare Exception for an id it cannot decode)."""

    def __init__(self, tokenizer, at: int):
        self._tokenizer, self._at, self._uses = tokenizer, at, 0

    @property
    def backend_tokenizer(self):
        self._uses += 1
        if self._uses == self._at:
            raise Exception("tokenizer: could not decode token")
        return self._tokenizer.backend_tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def inject(kind: str, monkeypatch, engine):
    if kind == "kernel error":                      # in a decode step
        fail_runner(monkeypatch, engine, 2, RuntimeError("triton: kernel launch failed"))
    elif kind == "out of memory in a prefill":      # the first step of fresh requests is their prefill
        fail_runner(monkeypatch, engine, 1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    elif kind == "non-finite logits":
        fail_runner(monkeypatch, engine, 2, poison=True)
    else:                                           # after the first request's first token
        monkeypatch.setattr(engine.committer, "tokenizer", BrokenTokenizer(engine.committer.tokenizer, 2))
