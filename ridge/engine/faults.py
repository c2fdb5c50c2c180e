"""What a failed step costs: the requests it touched, not the engine.

An exception inside a step (a kernel that raises, out of memory in a prefill, non-finite logits,
a tokenizer that fails to detokenize) leaves the sequences of that step half advanced: tokens
appended or not, placeholders of an overlapped step unfilled, pages allocated for tokens never
written. Those requests are ended (every sample of each: a request with n > 1 is one answer),
their pages go back to the pool, an overlapped step launched ahead of them is dropped, and the
step raises StepFault naming them; the requests waiting and the engine itself are untouched, so
the next step serves on. A speculative proposer's and a grammar's state of an ended sequence go
with it (the proposer's at its next plan, as for any aborted sequence).

A device error (CUDA's "illegal memory access", a device-side assert: torch.AcceleratorError) is
another matter: the CUDA context is then unusable for every later call, in any request. StepFault
says so (`fatal`), and the engine refuses every later step; a server turns that into a failing
/health and a non-zero exit, for its supervisor to restart it.
"""
from __future__ import annotations

import torch

# what torch's messages say when the CUDA context itself is lost (errors that stay for every later call)
DEVICE_LOST = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
               "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address", "illegal instruction")


class StepFault(RuntimeError):
    """An engine step failed: the requests in `request_ids` were ended and their pages freed.
    `fatal`: the device is lost and the engine runs no further step (build a new process).
    `reason`: what failed, short enough for an API error message (the cause is chained)."""

    def __init__(self, reason: str, request_ids: list[str], fatal: bool):
        ended = f"; ended request(s) {', '.join(request_ids)}" if request_ids else ""
        then = "the device is lost: no further step can run" if fatal else "the engine serves on"
        super().__init__(f"engine step failed ({reason}){ended}; {then}")
        self.reason, self.request_ids, self.fatal = reason, request_ids, fatal


class NonFiniteLogits(RuntimeError):
    """A sampled row's logits were NaN or infinite (the model's numbers overflowed)."""


def unrecoverable(error: BaseException) -> bool:
    """Whether `error` leaves the CUDA context unusable. Out of memory does not: the allocator
    raises before anything is launched."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in text:
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(m in text for m in DEVICE_LOST)


def end_touched(engine, error: Exception) -> StepFault:
    """End every request the failed step touched, free their pages and drop the step launched
    ahead; returns the StepFault to raise. Touched: every request with a running sequence (a
    step schedules what runs), those of the in-flight overlapped step, and those that finished
    in this step (finished requests leave `engine.requests` as their step returns, so one still
    there finished in the step that failed, and its output never went out). Bookkeeping that
    cannot be put right makes the fault fatal."""
    reason = str(error) if isinstance(error, NonFiniteLogits) else type(error).__name__
    fatal = unrecoverable(error)
    touched = {s.request.request_id: s.request for s in engine.scheduler.running}
    if engine.overlap.inflight is not None:
        touched.update((s.request.request_id, s.request) for s in engine.overlap.inflight.seqs)
    touched.update((rid, r) for rid, r in engine.requests.items() if r.is_finished)
    engine.overlap.inflight = None
    try:
        for rid, req in touched.items():
            engine.requests.pop(rid, None)
            engine.scheduler.abort_request(req)
    except Exception:               # noqa: BLE001 - the engine's own state is now unknown
        fatal = True
    if fatal:
        engine.fault = reason
    return StepFault(reason, list(touched), fatal)


def readback_ids(logits: torch.Tensor, tokens: torch.Tensor, greedy: bool) -> torch.Tensor:
    """The ids to read back to the host: each row's sampled id, or -1 where the row's largest
    logit is not finite (a NaN or +inf anywhere in the row, or nothing but -inf; a masked -inf
    beside finite logits is no fault). The ids are read back anyway (the sampler's one sync), so
    the check adds no wait of its own. It reads one logit a row at the row's argmax (torch's argmax
    picks a NaN): in a step whose rows are all greedy (`greedy`) that is the sampled id, so the
    check costs a gather; otherwise the argmax is taken, one pass over the logits beside the
    sampler's softmax, sort and noise. `tokens` itself stays as it is: an overlapped step feeds it
    to the next forward, which needs valid ids. (Rows verified against drafts are sampled by the
    speculator's verification, ridge/engine/spec, and not checked here.)"""
    probe = tokens if greedy else logits.argmax(dim=-1)
    peak = logits.gather(-1, probe[:, None]).squeeze(-1)
    return torch.where(torch.isfinite(peak), tokens, torch.full_like(tokens, -1))


def check_finite(ids: list[int], seqs: list) -> None:
    """Raise NonFiniteLogits if a row of `readback_ids` was flagged."""
    bad = sorted({seqs[i].request.request_id for i, t in enumerate(ids) if t < 0})
    if bad:
        raise NonFiniteLogits(f"non-finite logits (NaN or inf) for request(s) {', '.join(bad)}")
