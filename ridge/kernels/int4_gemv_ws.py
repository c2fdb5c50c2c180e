"""W4A16 decode GEMV, warp-specialized (Gluon, Hopper): y = x @ dequantize(qweight, scales, zeros)
for M <= 16 rows, with a loader warp that streams the weights by TMA into a deep shared-memory ring.

The Triton kernel beside it (ridge/kernels/int4_gemv.py, whose docstring has the layout and the
dequantization) keeps its weights in flight with cp.async issued by the same warps that
dequantize and multiply: its few warps a program walk one dependent chain (wait for a stage,
dequantize, MMA, issue the next copies), and on an H200 it runs at the H100's speed, bound by that
chain rather than by HBM. Here the two jobs are separate partitions of one program:

  * The loader: one warp with a small register budget. For each K tile it waits until the ring
    slot is free, arms the slot's mbarrier with the tile's bytes and issues one TMA copy of the
    [BLOCK_K / 8, BLOCK_N] packed words. It never waits on the multiplies, so STAGES tiles
    (STAGES x 8 KB) are in flight per program whatever the consumers are doing.
  * The consumers (the default partition, num_warps warps): per tile, wait on the slot, read the
    words from shared memory straight into the MMA's B-operand registers, free the slot, and run
    the eight nibble planes through mma.sync with x's matching planes (read from global: x is a few
    KB and stays in L1/L2). The plane extraction is the same prmt / shr / lop3 sequence (two
    weights per instruction, 128 + q in bf16), minus 128 + z by one packed subtraction.

Scope: group_size a multiple of BLOCK_K (the tile's scale applies after its MMAs), N a multiple of
BLOCK_N and K of BLOCK_K x SPLIT_K, 16-bit activations. Split-K partials are reduced in the same
launch by the last program of a column block to take its ticket, in split order (deterministic),
as in the Triton kernel, whose ticket table this shares. No programmatic dependent launch yet: it
is launched without the PDL attribute.

The interpreter does not run Gluon: on a CPU the reference (ridge/kernels/int4_matmul.py) is what
runs, and tests/kernels/test_int4_gemv_ws.py checks this kernel on the GPU and compiles it for sm_90
on the CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ridge.kernels.int4_gemv import COUNTER_SLOTS, PLANE_ASM, ticket_counters

# Triton 3.6 (the GPU machines) names the TMA load async_copy_global_to_shared, newer ones async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier          # likewise: thread_barrier in 3.6
_B0, _B1, _B2, _B3, _B4, _B5, _B6, _B7 = (gl.constexpr(a) for a in PLANE_ASM["bf16"])
_H0, _H1, _H2, _H3, _H4, _H5, _H6, _H7 = (gl.constexpr(a) for a in PLANE_ASM["fp16"])


# registers a thread, the kernel's cap: its warps (the consumers, the loader and the warpgroup's
# idle rest) x 32 x 128 is half an SM's register file, so two programs fit an SM
MAX_REGISTERS = 128


class Int4GemvWsConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int      # consumer warps
    stages: int         # ring slots
    split_k: int


@gluon.jit
def _plane(w, J: gl.constexpr, DT: gl.constexpr):
    """Nibble J of every word of w as MAGIC + q in DT, two words per instruction sequence."""
    if DT == gl.bfloat16:
        A: gl.constexpr = (_B0, _B1, _B2, _B3, _B4, _B5, _B6, _B7)[J]
        return gl.inline_asm_elementwise(A, "=r,r,r", [w], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        A: gl.constexpr = (_H0, _H1, _H2, _H3, _H4, _H5, _H6, _H7)[J]
        return gl.inline_asm_elementwise(A, "=r,r,r", [w], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _plane_mma(acc, xj, w, zq, J: gl.constexpr):
    """acc += x plane J (x[:, 8i + J]) @ (weight plane J - z), on tensor cores."""
    return mma_v2(xj, _plane(w, J, xj.dtype) - zq, acc)


@gluon.jit
def _loader(qw_desc, bufs, ready, empty, n0, row0, TILES: gl.constexpr, STAGES: gl.constexpr):
    BK8: gl.constexpr = qw_desc.block_type.shape[0]
    for t in range(TILES):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)     # a new barrier passes phase 1
        mbarrier.expect(ready.index(s), qw_desc.block_type.nbytes)
        _tma_load(qw_desc, [row0 + t * BK8, n0], ready.index(s), bufs.index(s))


@gluon.jit
def _consumer(X, S, Z, bufs, ready, empty, M, N, stride_xm, n0, k_first,
              G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              TILES: gl.constexpr, STAGES: gl.constexpr, W: gl.constexpr):
    DT: gl.constexpr = X.dtype.element_ty
    MAGIC: gl.constexpr = 128.0 if DT == gl.bfloat16 else 1024.0
    BK8: gl.constexpr = BK // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    xl: gl.constexpr = gl.BlockedLayout([1, 1, 8], [2, 16, 1], [W, 1, 1], [2, 1, 0])
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
    offs_i = gl.arange(0, BK8, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
    offs_e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
    x_ptrs = (X + gl.expand_dims(gl.expand_dims(offs_m, 1), 2) * stride_xm
              + gl.expand_dims(gl.expand_dims(8 * offs_i, 0), 2) + gl.expand_dims(gl.expand_dims(offs_e, 0), 1))
    x_mask = gl.expand_dims(gl.expand_dims(offs_m < M, 1), 2)
    offs_nb = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, b_l))
    offs_nc = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for t in range(TILES):
        k0 = k_first + t * BK
        g = k0 // G
        zq = gl.expand_dims((gl.load(Z + g * N + offs_nb).to(gl.float32) + MAGIC).to(DT), 0)
        sc = gl.expand_dims(gl.load(S + g * N + offs_nc).to(gl.float32), 0)
        # x's tile in 16-byte rows (8 consecutive k a thread), split into its planes in registers
        xt = gl.reshape(gl.load(x_ptrs + k0, mask=x_mask, other=0.0), [BM, BK8, 2, 2, 2])
        e, o = gl.split(xt)
        e0, e1 = gl.split(e)
        o0, o1 = gl.split(o)
        x0, x4 = gl.split(e0)
        x2, x6 = gl.split(e1)
        x1, x5 = gl.split(o0)
        x3, x7 = gl.split(o1)
        x0 = gl.convert_layout(x0, a_l)
        x1 = gl.convert_layout(x1, a_l)
        x2 = gl.convert_layout(x2, a_l)
        x3 = gl.convert_layout(x3, a_l)
        x4 = gl.convert_layout(x4, a_l)
        x5 = gl.convert_layout(x5, a_l)
        x6 = gl.convert_layout(x6, a_l)
        x7 = gl.convert_layout(x7, a_l)
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        w = bufs.index(s).load(b_l)
        fence_async_shared()                    # the read is ordered before the slot's next TMA write
        mbarrier.arrive(empty.index(s), count=1)
        d = gl.zeros([BM, BN], gl.float32, mma)
        d = _plane_mma(d, x0, w, zq, 0)
        d = _plane_mma(d, x1, w, zq, 1)
        d = _plane_mma(d, x2, w, zq, 2)
        d = _plane_mma(d, x3, w, zq, 3)
        d = _plane_mma(d, x4, w, zq, 4)
        d = _plane_mma(d, x5, w, zq, 5)
        d = _plane_mma(d, x6, w, zq, 6)
        d = _plane_mma(d, x7, w, zq, 7)
        acc += d * sc                           # the group's scale, once per tile
    return (acc,)                               # a tuple: Triton 3.6 flattens the default partition's results


@gluon.jit
def _int4_gemv_ws_kernel(X, qw_desc, S, Z, Y, P, C, M, N, stride_xm, stride_ym,
                         G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                         TILES: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                         num_warps: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BN
    k_first = pid_k * TILES * BK
    bufs = gl.allocate_shared_memory(qw_desc.dtype, [STAGES] + qw_desc.block_type.shape, qw_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    results = gl.warp_specialize([
        (_consumer, (X, S, Z, bufs, ready, empty, M, N, stride_xm, n0, k_first, G, BM, BN, BK, TILES, STAGES,
                     num_warps)),
        (_loader, (qw_desc, bufs, ready, empty, n0, k_first // 8, TILES, STAGES)),
    ], [1], [24])
    acc = results[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps],
                                                  instr_shape=[16, 8])
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
    y_ptrs = Y + gl.expand_dims(offs_m, 1) * stride_ym + gl.expand_dims(offs_n, 0)
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        part = P + gl.expand_dims(offs_m, 1) * N + gl.expand_dims(offs_n, 0)
        gl.store(part + pid_k * M * N, acc, mask=mask)
        _cta_barrier()                     # every thread's partial before the ticket
        ticket = gl.atomic_add(C + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = gl.zeros([BM, BN], gl.float32, mma)
            for s in gl.static_range(SPLIT_K):    # fixed order: deterministic sums
                total += gl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask)
            gl.atomic_xchg(C + pid_n, 0, sem="relaxed", scope="gpu")
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def supported(M: int, N: int, K: int, group_size: int, dtype: torch.dtype, config: Int4GemvWsConfig) -> bool:
    """Whether the kernel takes this call (module docstring: its scope)."""
    return (M <= 16 and dtype in (torch.bfloat16, torch.float16) and N % config.block_n == 0
            and K % (config.block_k * config.split_k) == 0 and group_size % config.block_k == 0)


def weight_layout(block_n: int) -> gl.NVMMASharedLayout:
    """The ring's shared layout: 128-byte swizzle of the int32 words (TMA writes it, the B-operand
    read spreads over the banks)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def int4_gemv_ws(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, out: torch.Tensor, config: Int4GemvWsConfig) -> torch.Tensor:
    """out = x @ W for validated inputs (int4_matmul checks them) inside `supported`."""
    M, K = x.shape
    N = qweight.shape[1]
    cfg = Int4GemvWsConfig(*config)
    if not supported(M, N, K, group_size, x.dtype, cfg):
        raise ValueError(f"int4_gemv_ws: M={M} N={N} K={K} group_size={group_size} {x.dtype} is outside the "
                         f"kernel's scope for {cfg}")
    blocks = N // cfg.block_n
    if blocks > COUNTER_SLOTS:
        raise ValueError(f"int4_gemv_ws: N = {N} needs {blocks} split-K counters, more than {COUNTER_SLOTS}")
    desc = TensorDescriptor.from_tensor(qweight, [cfg.block_k // 8, cfg.block_n], weight_layout(cfg.block_n))
    if cfg.split_k > 1:
        partials = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device)
    else:
        partials = counters = out                # unused
    tiles = K // cfg.block_k // cfg.split_k
    _int4_gemv_ws_kernel[(blocks, cfg.split_k)](
        x, desc, scales, zeros, out, partials, counters, M, N, x.stride(0), out.stride(0),
        G=group_size, BM=16, BN=cfg.block_n, BK=cfg.block_k, TILES=tiles, STAGES=cfg.stages,
        SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, maxnreg=MAX_REGISTERS)
    return out
