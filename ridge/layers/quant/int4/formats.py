"""The INT4 checkpoint formats users have, converted to and from ridge's one in-memory layout.

ridge's layout (ridge/kernels/int4_matmul.py): qweight int32 [K // 8, N] packed along K, scales and
zero points [ceil(K / G), N] in the activation dtype, W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
Where G does not divide K the last group is short and still has its row: AutoGPTQ (math.ceil) and
compressed-tensors (strategy_cdiv) size their group tables so; AutoAWQ refuses such layers.
Every format stores the same numbers (4-bit q, one scale and one zero point per group of G inputs
of an output) in a different word order; the converters below only move nibbles. In each format
q and z are unsigned 4-bit values in [0, 15] and W = (q - z) * s.

AutoAWQ GEMM (`quant_method: awq`, `version: gemm`; AutoAWQ's WQLinear_GEMM, vLLM awq.py):
  qweight int32 [K, N / 8]      packed along N; nibble i (bits 4i..4i+3) of word [k, c] holds
                                column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [K / G, N / 8]  z, packed like qweight
  scales  fp16  [K / G, N]
GPTQ (`quant_method: gptq`; AutoGPTQ / GPTQModel QuantLinear, vLLM gptq.py):
  qweight int32 [K / 8, N]      packed along K in order: nibble j of word [i, n] is q[8i + j, n]
  qzeros  int32 [G', N / 8]     packed along N in order; `checkpoint_format: gptq` (v1, the default)
                                stores z - 1 (the reader adds 1 back), `gptq_v2` stores z
  scales  fp16  [G', N]
  g_idx   int32 [K]             the group of each input row. With `desc_act` (act-order) GPTQ
                                quantised the rows in a permuted order, so g_idx is not k // G
                                and a group's rows are scattered over K (the layer sorts them).
compressed-tensors `pack-quantized` (llm-compressor's output, vLLM compressed_tensors_wNa16):
  weight_packed     int32 [N, K / 8]  packed along K in order; the signed int4 value v in [-8, 7]
                                      is stored as v + 8 (pack_to_int32's offset), i.e. q
  weight_scale      [N, K / G]        the checkpoint's float dtype
  weight_zero_point int32 [N / 8, K / G]  asymmetric only: the signed zero point + 8 (= z), packed
                                      along N (packed_dim 0); symmetric schemes omit it (z = 8)
  weight_shape      int64 [2]         [N, K]
  weight_g_idx      int32 [K]         only with actorder "group" (older llm-compressor)

ridge writes compressed-tensors pack-quantized (`ridge quantize`): it is what llm-compressor, the
tool vLLM documents for INT4, emits, vLLM loads it (Marlin, symmetric or with zero points), its
config.json entry says everything a reader needs (bits, group size, symmetry, which modules are
left out) in one schema, and its [N, K]-major tensors keep the HF weight's orientation, so a
tensor-parallel reader slices it like the bf16 weight. AutoAWQ's layout has a fixed fp16 scale,
a nibble order only its kernels want, and a config without a module list of its own.
"""
from __future__ import annotations

import torch

from ridge.kernels.int4_matmul import PACK

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its 8
SEQUENTIAL = tuple(range(PACK))
MAX_Q = 15
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


# -- each format's tensors, as Int4Linear (ridge/layers/quant/int4.py) registers, checks and splits them --
# checkpoint tensor name of each table, per format (tables with no tensor are buffers of their own name)
TABLE_NAMES = {"awq": {"qweight": "qweight", "zeros": "qzeros", "scales": "scales"},
          "gptq": {"qweight": "qweight", "zeros": "qzeros", "scales": "scales", "g_idx": "g_idx"},
          "compressed-tensors": {"qweight": "weight_packed", "zeros": "weight_zero_point", "scales": "weight_scale",
                                 "shape": "weight_shape", "g_idx": "weight_g_idx"},
          "int4": {"qweight": "weight"}}
# per (format, table): the checkpoint tensor's shape from (K, shard outputs n, groups), its dtypes, and what it is
TABLE_SPECS = {
    ("awq", "qweight"): (lambda k, n, g: (k, n // PACK), (torch.int32,), "AutoAWQ GEMM qweight [K, N/8] int32"),
    ("awq", "zeros"): (lambda k, n, g: (g, n // PACK), (torch.int32,), "AutoAWQ GEMM qzeros [K/G, N/8] int32"),
    ("awq", "scales"): (lambda k, n, g: (g, n), _FLOAT, "AutoAWQ GEMM scales [K/G, N]"),
    ("gptq", "qweight"): (lambda k, n, g: (k // PACK, n), (torch.int32,), "GPTQ qweight [K/8, N] int32"),
    ("gptq", "zeros"): (lambda k, n, g: (g, n // PACK), (torch.int32,), "GPTQ qzeros [K/G, N/8] int32"),
    ("gptq", "scales"): (lambda k, n, g: (g, n), _FLOAT, "GPTQ scales [K/G, N]"),
    ("gptq", "g_idx"): (lambda k, n, g: (k,), (torch.int32, torch.int64), "GPTQ g_idx [K] int32"),
    ("compressed-tensors", "qweight"): (lambda k, n, g: (n, k // PACK), (torch.int32,),
                                        "compressed-tensors weight_packed [N, K/8] int32"),
    ("compressed-tensors", "zeros"): (lambda k, n, g: (n // PACK, g), (torch.int32,),
                                      "compressed-tensors weight_zero_point [N/8, K/G] int32"),
    ("compressed-tensors", "scales"): (lambda k, n, g: (n, g), _FLOAT, "compressed-tensors weight_scale [N, K/G]"),
    ("compressed-tensors", "shape"): (lambda k, n, g: (2,), (torch.int64, torch.int32),
                                      "compressed-tensors weight_shape [2] int64"),
    ("compressed-tensors", "g_idx"): (lambda k, n, g: (k,), (torch.int32, torch.int64),
                                      "compressed-tensors weight_g_idx [K] int32"),
    ("int4", "qweight"): (lambda k, n, g: (n, k), _FLOAT, "a float weight [N, K] to quantize at load"),
}
# per (format, table), where a tensor-parallel rank's part is cut (Linear.rank_share): the dimension of
# outputs and how many one element stands for, then the same for inputs ("g": a group); None: not split
TABLE_SPLITS = {
    ("awq", "qweight"): (1, PACK, 0, 1), ("awq", "zeros"): (1, PACK, 0, "g"), ("awq", "scales"): (1, 1, 0, "g"),
    ("gptq", "qweight"): (1, 1, 0, PACK), ("gptq", "zeros"): (1, PACK, 0, "g"), ("gptq", "scales"): (1, 1, 0, "g"),
    ("gptq", "g_idx"): (None, 1, 0, 1),
    ("compressed-tensors", "qweight"): (0, 1, 1, PACK), ("compressed-tensors", "zeros"): (0, PACK, 1, "g"),
    ("compressed-tensors", "scales"): (0, 1, 1, "g"), ("compressed-tensors", "shape"): (None, 1, None, 1),
    ("compressed-tensors", "g_idx"): (None, 1, 0, 1),
    ("int4", "qweight"): (0, 1, 1, 1),
}


# -- nibbles ---------------------------------------------------------------------------------------
def pack_last(q: torch.Tensor, order=SEQUENTIAL) -> torch.Tensor:
    """[R, C] integers in [0, 15] -> [R, C // 8] int32 packed along the last dim: nibble i of word
    [r, c] holds q[r, 8c + order[i]]."""
    r, c = q.shape
    if c % PACK:
        raise ValueError(f"has {c} columns to pack, not a multiple of {PACK}")
    q = q.to(torch.int64).reshape(r, c // PACK, PACK)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (q << shifts).sum(dim=2)                             # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_last(packed: torch.Tensor, order=SEQUENTIAL) -> torch.Tensor:
    """[R, C // 8] int32 -> [R, C] int32 in [0, 15], the inverse of pack_last."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF                  # [R, C/8, 8]: nibble i
    inverse = [order.index(j) for j in range(PACK)]               # column j sits in nibble inverse[j]
    return nib[:, :, inverse].reshape(packed.shape[0], -1)


# -- quantization (round to nearest) --------------------------------------------------------------
def quantize_rtn(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32,
                 symmetric: bool = False):
    """Min-max round-to-nearest of w [N, K] in groups of `group_size` along K: (q [N, K] int32 in
    [0, 15], scales [N, ceil(K / G)] in scale_dtype, zeros [N, ceil(K / G)] int32). Asymmetric: the
    range always holds 0 (as compressed-tensors' min-max observer), so z is in [0, 15]; symmetric:
    z = 8 and s = max |w| / 7.5 (compressed-tensors' signed int4). q is computed with the stored
    (rounded) scale, so dequantize() is exactly what a reader of the checkpoint computes. A short
    last group is quantized padded with zeros, which change neither range (both hold 0)."""
    n, k = w.shape
    g = torch.nn.functional.pad(w.float(), (0, -k % group_size)).reshape(n, -1, group_size)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    span = 2 * torch.maximum(-lo, hi) if symmetric else hi - lo
    scales = (span / MAX_Q).clamp(min=1e-5).to(scale_dtype)
    s = scales.float()
    zeros = torch.full_like(s, 8.0) if symmetric else torch.round(-lo / s).clamp(0, MAX_Q)
    q = (torch.round(g / s.unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0, MAX_Q)
    return q.reshape(n, -1)[:, :k].to(torch.int32), scales, zeros.to(torch.int32)


def group_index(k: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    return torch.arange(k) // group_size if g_idx is None else g_idx.long()


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 [N, K] weight of q [N, K], scales / zeros [N, groups] (None: symmetric, z = 8);
    input row k belongs to group g_idx[k] (default k // group_size)."""
    g = group_index(q.shape[1], group_size, g_idx).to(q.device)
    z = 8.0 if zeros is None else zeros.float()[:, g]
    return (q.float() - z) * scales.float()[:, g]


def _check_codes(name: str, t: torch.Tensor, lo: int = 0, hi: int = MAX_Q) -> None:
    if t.dtype.is_floating_point or t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"{name}: must be integers in [{lo}, {hi}]")


# -- AutoAWQ GEMM ----------------------------------------------------------------------------------
def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One layer's AutoAWQ GEMM tensors from q [N, K], scales / zeros [N, ceil(K / G)]."""
    _check_codes("q", q), _check_codes("zeros", zeros)
    return {"qweight": pack_last(q.t(), AWQ_ORDER), "qzeros": pack_last(zeros.t(), AWQ_ORDER),
            "scales": scales.t().to(torch.float16).contiguous()}


def awq_config(group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """config.json's quantization_config as AutoAWQ writes it (transformers' AwqConfig keys)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": modules_to_not_convert}


# -- GPTQ ------------------------------------------------------------------------------------------
def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              g_idx: torch.Tensor | None = None, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One layer's GPTQ tensors from q [N, K], scales / zeros [N, groups] and the group of each input
    row (default k // G). v1 (`gptq`) stores z - 1, so it cannot hold z = 0 (AutoGPTQ's packer wraps it
    to 15, read back as 16): such zeros are refused here."""
    v1 = checkpoint_format == "gptq"
    _check_codes("q", q), _check_codes("zeros", zeros, 1 if v1 else 0)
    g = group_index(q.shape[1], group_size, g_idx)
    return {"qweight": _pack_k(q.t()), "qzeros": pack_last(zeros.t() - int(v1)),
            "scales": scales.t().to(torch.float16).contiguous(), "g_idx": g.to(torch.int32)}


def _pack_k(q_kn: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [K // 8, N] packed along K in order (GPTQ's qweight, ridge's layout)."""
    return pack_last(q_kn.t().contiguous()).t().contiguous()


def gptq_config(group_size: int, desc_act: bool = False, sym: bool = False, checkpoint_format: str = "gptq") -> dict:
    """config.json's quantization_config as GPTQModel / optimum write it."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "true_sequential": True, "lm_head": False, "checkpoint_format": checkpoint_format}


# -- compressed-tensors pack-quantized -------------------------------------------------------------
def pack_compressed_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                            group_size: int) -> dict[str, torch.Tensor]:
    """One layer's compressed-tensors pack-quantized tensors (no module prefix) from q [N, K] in
    [0, 15], scales [N, ceil(K / G)] (stored as given: the checkpoint's dtype) and zeros [N, ceil(K / G)],
    or None for a symmetric scheme (z = 8: the signed value's offset, no zero-point tensor)."""
    n, k = q.shape
    _check_codes("q", q)
    if scales.shape != (n, -(-k // group_size)):
        raise ValueError(f"scales: expected shape {(n, -(-k // group_size))} for q {tuple(q.shape)} and group "
                         f"size {group_size}, got {tuple(scales.shape)}")
    out = {"weight_packed": pack_last(q), "weight_scale": scales.contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zeros is not None:
        _check_codes("zeros", zeros)
        out["weight_zero_point"] = pack_last(zeros.t()).t().contiguous()      # packed along N
    return out


def compressed_tensors_config(group_size: int, symmetric: bool, ignore: list[str] | None = None) -> dict:
    """config.json's quantization_config for W4A16 pack-quantized, as llm-compressor writes it
    (compressed-tensors' QuantizationConfig, compressed) and vLLM's CompressedTensorsConfig reads it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group_size,
               "strategy": "group", "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore if ignore is not None else ["lm_head"]), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}}


# -- reading: checkpoint tensors -> q, z as [rows, cols] codes (the layer packs them along K) --------
def awq_codes(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ qweight [K, n / 8] or qzeros [groups, n / 8] -> [K or groups, n] codes."""
    return unpack_last(packed, AWQ_ORDER)


def gptq_zeros(qzeros: torch.Tensor, checkpoint_format: str) -> torch.Tensor:
    """GPTQ qzeros [groups, n / 8] -> z [groups, n] (v1 stored z - 1)."""
    return unpack_last(qzeros) + int(checkpoint_format == "gptq")


def ct_codes(weight_packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors weight_packed [n, K / 8] -> q [n, K] in [0, 15] (the signed value + 8)."""
    return unpack_last(weight_packed)


def ct_zeros(weight_zero_point: torch.Tensor) -> torch.Tensor:
    """compressed-tensors weight_zero_point [n / 8, groups] -> z [n, groups] (the signed zero + 8)."""
    return unpack_last(weight_zero_point.t().contiguous()).t()
