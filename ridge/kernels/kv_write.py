"""Scatter the new tokens' K/V rows into their paged-cache slots (Triton).

One program per token copies its [kv_heads, head_dim] K and V rows. In the cache a slot's row is
kv_heads * head_dim contiguous elements, so each program issues a couple of wide, fully coalesced
stores; the inputs may be strided views (e.g. slices of a fused QKV projection output). A negative
slot marks a padding token (e.g. a CUDA-graph pad) and is skipped.

The engine writes the cache through ridge.kernels.rotary.rope_write_kv, which rotates k and
writes it in the same launch, with this file's slot rule (`slot_row`); `write_kv` is the
separate kernel that fused one is checked and timed against.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_row(Cache, slot, stride_cb, stride_ct, PAGE: tl.constexpr):
    """The cache row of a slot: page slot // PAGE, row slot % PAGE (slot >= 0)."""
    return Cache + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct


@triton.jit
def _write_kv_kernel(K, V, K_cache, V_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:
        return
    k_row = slot_row(K_cache, slot, stride_kcb, stride_kct, PAGE)
    v_row = slot_row(V_cache, slot, stride_vcb, stride_vct, PAGE)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(K + tok * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(k_row + offs_h * stride_kch + offs_d, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(v_row + offs_h * stride_vch + offs_d, v.to(V_cache.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v ([T, kvh, d]) into k_cache, v_cache ([blocks, page, kvh, d]) at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs caches whose last dim is contiguous")
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(num_kv_heads)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 2)
