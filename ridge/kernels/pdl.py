"""Programmatic dependent launch (PDL) for the kernels of a decode step (Hopper and later).

A batch-1 decode step of an 8B model is ~300 short kernels in a row, each reading its input from
the one before. In a CUDA graph each boundary still costs the drain of the last wave of one
kernel, the launch of the next and its prologue (index math, the first loads in flight) with
the memory system idle. With PDL the next kernel is launched while the previous one is still
running: its programs become resident as soon as every program of the previous kernel has
started, do whatever does not depend on the previous kernel's output (the GEMV issues the loads
of its first weight tile: the weights are never written), and then block in
`griddepcontrol.wait` until the previous grid has completed and its memory is visible.
BENCHMARKS.md has the same-run A/B that made it the default.

The rules every kernel launched with PDL follows (`pdl_wait` below):
* It calls `pdl_wait` in every program before it reads anything an earlier kernel of the step
  wrote, and before any early return. A kernel that could finish without waiting would let the
  kernel after it start while the one before it still runs, breaking the chain of "complete
  before" that the later kernels rely on.
* It signals `launch_dependents` only after its wait, so at most one kernel runs ahead of the
  one computing: the waiting programs hold registers and shared memory, and a longer cascade of
  them could crowd the SMs.
Kernels not launched with PDL (torch's own, the prefill kernel) keep plain stream order, and a
PDL launch after one of them simply starts when it completes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel reading t is launched with PDL: a CUDA tensor on compute capability >= 9.0,
    outside Triton's interpreter (a CUDA graph keeps the choice made when it was captured)."""
    if not t.is_cuda or triton.knobs.runtime.interpret:
        return False
    return _supports_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords for a Triton kernel: {} without PDL (the interpreter takes no
    launch_pdl), else launch_pdl=True."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has completed (its writes visible), then let
    the next one launch. A no-op unless the kernel was launched with PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
