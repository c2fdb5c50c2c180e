"""Tile order shared by ridge's GEMM kernels."""
from __future__ import annotations

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
