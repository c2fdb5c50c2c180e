"""Tile order and grid sizing shared by ridge's kernels."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program pid in grouped raster order: GROUP_M row blocks sweep the same
    column blocks together, so neighbouring programs share x and W tiles in L2 (Triton's matmul
    tutorial's order)."""
    m_blocks = tl.cdiv(M, BM)
    n_blocks = tl.cdiv(N, BN)
    first_m = pid // (GROUP_M * n_blocks) * GROUP_M
    rows_here = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_blocks)) % rows_here
    pid_n = (pid % (GROUP_M * n_blocks)) // rows_here
    return pid_m, pid_n


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device, elsewhere: int = 132) -> int:
    """The SMs a grid must fill on a CUDA device (a property query is a driver call: cached per
    device); `elsewhere` off CUDA (the interpreter), where the caller's launch shape stands in."""
    if device.type != "cuda":
        return elsewhere
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
