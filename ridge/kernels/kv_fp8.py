"""The FP8 KV cache's format: e4m3 rows with one power-of-two scale per token and kv head.

A cached K or V row (one token, one kv head: head_dim values) is stored as head_dim e4m3 bytes
plus one scale byte, in e8m0 form (the OCP MX scale: the byte b means 2^(b - 127)):

    k_cache, v_cache:  [pages, page, kv heads, head_dim]  float8_e4m3fn
    k_scale, v_scale:  [pages, page, kv heads]            uint8 (e8m0)

Why this shape of scale:
  * Per token and head, not per layer: a row's scale comes from its own absolute maximum when it
    is written (in the fused RoPE + KV-write kernel, from registers), so no calibration pass and
    no checkpoint scales are needed, and one outlier token cannot coarsen every other token.
  * A power of two: dividing by it is exact, so the quantized row is the row's own e4m3 rounding,
    and a dequantized value (e4m3 x 2^e) is exact in bf16. The scale is chosen from the exponent
    bits of the row's maximum, so it is exact integer arithmetic in the kernel and in torch: with
    amax in [2^E, 2^(E+1)), scale = 2^(E - 7) puts the row's maximum in [128, 256] (256 by rounding), inside e4m3's
    range (448) with no clamping, at the same relative precision as any other choice (e4m3 is a
    float: its 3 mantissa bits are relative, whatever the scale).
  * One byte: a token's K and V in bf16 are 4 * head_dim bytes per kv head, in FP8 2 * (head_dim
    + 1), so the page pool holds 2 * head_dim / (head_dim + 1) times the pages (1.98x at 128).

Incoherent processing (FlashAttention-3, seed 004): `hadamard_signs` gives the orthogonal matrix
M = H D / sqrt(d) (H the Sylvester Hadamard matrix, D random signs). Rotating both q and k by it
after RoPE leaves every score unchanged (q M (k M)^T = q k^T) but spreads a key's outlier
channels over all channels, so the row's maximum, and with it the quantization step, shrinks
relative to the row's norm. V is not rotated (the output would have to be rotated back).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8
_MANTISSA_SHIFT = 7        # scale = 2^(E - 7): amax / scale lands in [128, 256)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


KVScales = tuple[torch.Tensor, torch.Tensor]


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_scales: KVScales | None) -> KVScales | None:
    """kv_scales if the caches are FP8 (validated), None if they are not; ValueError otherwise."""
    fp8 = is_fp8_cache(k_cache), is_fp8_cache(v_cache)
    if fp8[0] != fp8[1]:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must both be FP8 or neither")
    if not fp8[0]:
        if kv_scales is not None:
            raise ValueError(f"kv_scales given for a {k_cache.dtype} cache: only an FP8 cache has scales")
        return None
    if kv_scales is None:
        raise ValueError("an FP8 KV cache needs kv_scales=(k_scale, v_scale), uint8 [pages, page, kv_heads]")
    if len(kv_scales) != 2:
        raise ValueError(f"kv_scales must be the pair (k_scale, v_scale), got {len(kv_scales)} tensors")
    for name, s, cache in zip(("k_scale", "v_scale"), kv_scales, (k_cache, v_cache)):
        if s.dtype != SCALE_DTYPE:
            raise ValueError(f"{name} must be uint8 (e8m0 scale bytes), got {s.dtype}")
        if s.shape != cache.shape[:3]:
            raise ValueError(f"{name} shape {tuple(s.shape)} must be the cache's [pages, page, kv_heads] "
                             f"{tuple(cache.shape[:3])}")
        if s.device != cache.device:
            raise ValueError(f"{name} is on {s.device}, the cache on {cache.device}")
    return kv_scales[0], kv_scales[1]


def scale_bytes_of(x: torch.Tensor) -> torch.Tensor:
    """The e8m0 scale byte of each row of x [..., d] (the last dim is the row)."""
    amax = x.float().abs().amax(dim=-1)
    exponent = (amax.view(torch.int32) >> 23) & 0xFF                 # biased exponent of amax
    return (exponent - _MANTISSA_SHIFT).clamp(min=1).to(SCALE_DTYPE)


def scale_of(scale_bytes: torch.Tensor) -> torch.Tensor:
    """e8m0 byte -> its float32 power of two (byte 1 is 2^-126, the smallest used)."""
    return (scale_bytes.to(torch.int32) << 23).view(torch.float32)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (e4m3 [..., d], e8m0 bytes [...]): x / scale rounded to e4m3, nearest even."""
    b = scale_bytes_of(x)
    return (x.float() / scale_of(b)[..., None]).to(FP8), b


def dequantize_rows_ref(q: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale_of(scale_bytes)[..., None]).to(dtype)


def hadamard_signs(d: int, seed: int = 0) -> torch.Tensor:
    """S = H_d diag(random signs), float32 [d, d] of +-1; d a power of two. M = S / sqrt(d) is
    orthogonal: a row vector x is rotated as (x @ S) / sqrt(d). The +-1 entries are exact in any
    dtype, so the kernels multiply by S on the tensor cores and scale once in fp32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_signs: head_dim must be a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return h * signs.float()[None, :]


# ------------------------------------------------------------------ the same arithmetic in Triton
@triton.jit
def scale_bytes_from_amax(amax):
    """e8m0 scale bytes of rows whose absolute maxima (fp32) are amax (scale_bytes_of's arithmetic)."""
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.maximum(exponent - 7, 1)


@triton.jit
def inverse_scale_from_bytes(b):
    """1 / scale, exact (2^(127 - b) for b in [1, 254]): rows are quantized by multiplying by it."""
    return ((254 - b.to(tl.int32)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_from_bytes(b):
    """e8m0 bytes (any int tile) -> float32 powers of two."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def dequantize_tile(x, scale_bytes, DTYPE: tl.constexpr):
    """An e4m3 tile [N, d] with its rows' scale bytes [N] -> DTYPE (exact for bf16/fp16/fp32)."""
    return (x.to(tl.float32) * scale_from_bytes(scale_bytes)[:, None]).to(DTYPE)
