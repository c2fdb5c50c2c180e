"""INT4 weight-only matmul (W4A16): y = x @ dequantize(W) with group-wise scales and zero points.

ridge's one in-memory layout for 4-bit weights, whatever format the checkpoint used (AWQ, GPTQ,
compressed-tensors; the layer's weight_loader converts): for a layer with K inputs and N outputs,
  qweight  int32 [K // 8, N]: nibble j (bits 4j..4j+3) of qweight[i, n] is q[8 i + j, n], q in [0, 15];
  scales   [ceil(K / group_size), N], the activation dtype;
  zeros    [ceil(K / group_size), N], the activation dtype: the zero point z (an integer value);
  W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
K is a multiple of 8 (one word); group_size need not divide it: a short last group (DeepSeek-V2-Lite's
dense intermediate 10944 = 85.5 x 128) is one more row of scales and zeros, quantized as if padded
with zero weights (formats.quantize_rtn). Nothing is padded in memory: the kernels' K loop already
masks its last tile on the true K (x loads past K read 0, weight words past K // 8 are not read),
and a tile's group index k0 // group_size is that last row, so the padded and unpadded sums are the
same numbers; x reaches the kernel as it is, no padded copy on the hot path.
Packing along K keeps eight consecutive K elements of one output column in one 32-bit word: a
tile of the weight is a plain 2-D load with N contiguous (coalesced), and the eight nibbles of a
word are the eight K values one column's dot product needs next, so they are unpacked in
registers right before the multiply; the scale and zero of a group are one row of each table.

`int4_matmul` is the entry point: Triton kernels for CUDA tensors (and for CPU tensors under
TRITON_INTERPRET=1, so the interpreter tests run them), the torch reference otherwise.
  * M <= 32 rows: ridge/kernels/int4_gemv.py, the decode kernel: a weight stream dequantized in the
    MMA's operand registers, split-K reduced in the same launch.
  * M > 32: ridge/kernels/int4_gemm.py, an autotuned wgmma GEMM with the weight tile dequantized
    between its load and the MMA.
Both read this layout as it is: no re-layout at load time. The words of a tile row are N-contiguous
(16-byte coalesced loads as stored), and the skinny kernel gets the MMA operand layout by
permuting the order of K inside a tile (x is permuted to match, in registers) rather than by
reshuffling the weights in memory, so checkpoints' loaders hand their tensors over unchanged.
"""
from __future__ import annotations

import torch
import triton

PACK = 8            # int4 values per int32 word


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N] int32 values in [0, 15]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, PACK, 1)) & 0xF
    return q.reshape(qweight.shape[0] * PACK, qweight.shape[1])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[K, N] integers in [0, 15] (K a multiple of 8) -> [K // 8, N] int32, the inverse of unpack_int4."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"has {k} rows to pack, not a multiple of {PACK}")
    q = q.to(torch.int64).reshape(k // PACK, PACK, n)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64).view(1, PACK, 1)
    packed = (q << shifts).sum(dim=1)                              # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def groups_of(K: int, group_size: int) -> int:
    """Rows of the scale and zero tables: ceil(K / group_size) (a short last group is a row)."""
    return -(-K // group_size)


def group_size_error(group_size: int, K: int) -> str | None:
    """Why the kernels cannot run this group size at K inputs, or None: a multiple of PACK, and one
    of 32, 64, 128, a multiple of 128, or K (the K tiles, 64 or 128 wide, either hold whole groups
    or lie in one group: one scale row per tile or per word row)."""
    if group_size <= 0 or group_size % PACK:
        return f"must be a positive multiple of {PACK}"
    if group_size not in (32, 64, 128) and group_size != K and group_size % 128:
        return f"must be 32, 64, 128, a multiple of 128, or K = {K}"
    return None


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [K, N] weight the packed tables stand for (the reference every path matches);
    row k reads group k // group_size, so a short last group needs nothing of its own."""
    q = unpack_int4(qweight).float()
    group = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - zeros.float()[group]) * scales.float()[group]


def int4_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """x [M, K] @ W [K, N] in float32, returned in x's dtype."""
    return (x.float() @ dequantize_int4(qweight, scales, zeros, group_size)).to(x.dtype)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    K = x.shape[-1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"int4_matmul: qweight must be 2-D int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    N = qweight.shape[1]
    if K % PACK or qweight.shape[0] != K // PACK:
        raise ValueError(f"int4_matmul: x has K = {K} columns; qweight {tuple(qweight.shape)} needs K = "
                         f"{qweight.shape[0] * PACK} (a multiple of {PACK})")
    error = group_size_error(group_size, K)
    if error:
        raise ValueError(f"int4_matmul: group_size {group_size} {error}")
    groups = groups_of(K, group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (groups, N) or t.dtype != x.dtype:
            raise ValueError(f"int4_matmul: {name} must be [{groups}, {N}] {x.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")
    if not (x.device == qweight.device == scales.device == zeros.device):
        raise ValueError("int4_matmul: x, qweight, scales and zeros must be on one device")
    return N, K


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype, fp32 accumulation.

    qweight, scales, zeros in ridge's layout (module docstring); scales and zeros in x's dtype,
    zeros holding integers in [0, 16] (the kernels use them exactly in 16-bit arithmetic).
    group_size: 32, 64, 128 (or a multiple of 128), or K (one group per column); it need not divide
    K (a short last group: one more table row).
    bf16 / fp16 x on CUDA (or on the CPU under TRITON_INTERPRET=1) run the Triton kernels; other
    dtypes and plain CPU tensors run int4_matmul_ref. CUDA-graph capturable after one call on the
    device (the split-K ticket table is allocated on first use, the GEMM autotuned); calls on one
    device must not overlap in time on different streams (they share that table).
    """
    N, K = _check(x, qweight, scales, zeros, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    use_kernel = x.dtype in (torch.bfloat16, torch.float16) and (x.is_cuda or triton.knobs.runtime.interpret)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"int4_matmul: out must be [{M}, {N}] {x.dtype} on {x.device} with contiguous rows")
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    if not use_kernel:
        return out.copy_(int4_matmul_ref(x2, qweight, scales, zeros, group_size)).reshape(*lead, N)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    from ridge.kernels.int4_gemv import GEMV_MAX_M, int4_gemv   # noqa: PLC0415 - Triton kernels load lazily
    if M <= GEMV_MAX_M:
        int4_gemv(x2, qweight, scales, zeros, group_size, out)
    else:
        from ridge.kernels.int4_gemm import int4_gemm   # noqa: PLC0415
        int4_gemm(x2, qweight, scales, zeros, group_size, out)
    return out.reshape(*lead, N)
