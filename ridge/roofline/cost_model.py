"""FLOPs and minimum bytes of every op of one forward step, from the model config and the step's
shape: the "napkin math" of an LLM step, one op at a time.

The op list is what `ridge/models/llama.py` does, in order:

    embed -> per layer: norm (+residual), qkv_proj (merged), [qk_norm], rope_kv_write (rotary
    on q and k fused with the KV-cache write), attention, o_proj, norm (+residual), gate_up_proj
    (merged), activation (SiLU-and-mul), down_proj -> final_norm -> lm_head (only the rows that
    sample) -> sampling

Conventions (each is the ideal kernel's traffic, so that time / (bytes / bandwidth) says how far
a kernel is from the memory roof):
  - bytes are the minimum an ideal kernel moves between memory and the chip for the op as it is
    specified: each operand read once and each result written once; weights are read once per
    step whatever the token count (they are the reason decode is memory-bound);
  - a matrix product of [m, k] by [k, n] is 2*m*n*k FLOPs; bias adds m*n;
  - attention is 4 * head_dim FLOPs per (query head, query row, key) pair (Q.K and P.V); the
    softmax's few FLOPs per pair are left out, as in FlashAttention's own accounting; it reads
    Q, writes O and reads each sequence's K/V context once (GQA: once per KV head);
  - integer index tensors (token ids, positions, slots, page tables) move at most 8 bytes a
    token and are left out;
  - RMSNorm: x*x, accumulate, scale by 1/rms, scale by the weight: 4 FLOPs an element, +1 for
    the residual add; the final norm's residual output is never read, so it is not written;
  - SiLU-and-mul: sigmoid (exp, add, divide) times gate, times up: 5 FLOPs an output element;
  - rope_kv_write: q*cos + rotate(q)*sin: 3 FLOPs an element of q and k; reads q, k, v once
    and the cos/sin tables (float32, head_dim/2 distinct values of each per position, so
    4*head_dim bytes a token); writes the rotated q and k (the prefill kernel reads them) and
    the new K/V rows into the cache;
  - logits are float32 (the sampler works in float32); greedy sampling is one comparison a
    logit; random sampling counts 10 FLOPs a logit (temperature, softmax's max/subtract/exp/
    sum/divide, -log of the noise, divide by it, argmax) and reads the logits once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.config import ModelConfig

OPS = ("embed", "norm", "qkv_proj", "qk_norm", "rope_kv_write", "attention", "o_proj",
       "gate_up_proj", "activation", "down_proj", "final_norm", "lm_head", "sampling")
GEMM_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")

LOGIT_BYTES = 4                     # the sampler works on float32 logits
ROPE_TABLE_BYTES = 4                # cos/sin tables are float32
RANDOM_SAMPLING_FLOPS_PER_LOGIT = 10
NORM_FLOPS_PER_ELEMENT = 4
ACTIVATION_FLOPS_PER_ELEMENT = 5
ROTARY_FLOPS_PER_ELEMENT = 3


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each operand class, and the matrix roof the FLOPs run against."""
    name: str
    weight_bytes: float = 2.0       # GEMM weights, scales included (e.g. INT4 group 128: 0.5 + 2/128)
    act_bytes: float = 2.0          # activations, embeddings, norm weights
    kv_bytes: float = 2.0           # KV cache elements
    compute: str = "bf16"           # name of the measured matrix ceiling the GEMMs use
    head_bytes: float | None = None  # LM head weights (None: as weight_bytes); quantisers keep it 16-bit
    act_compute: str = "bf16"       # the ceiling of ops computed in the activation dtype

    @property
    def lm_head_bytes(self) -> float:
        return self.weight_bytes if self.head_bytes is None else self.head_bytes

    @classmethod
    def from_dtype(cls, dtype: torch.dtype) -> "Precision":
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
        if name is None:
            raise ValueError(f"dtype: no roofline precision for {dtype}")
        return PRECISIONS[name]


PRECISIONS = {
    "bf16": Precision("bf16", 2, 2, 2, "bf16"),
    "fp16": Precision("fp16", 2, 2, 2, "fp16", act_compute="fp16"),
    "fp32": Precision("fp32", 4, 4, 4, "fp32", act_compute="fp32"),
    # FP8 weights with one float32 scale per 128x128 block; activations quantised per 1x128
    # group inside the GEMM, so they still arrive in 16 bits; FP8 tensor cores.
    "fp8": Precision("fp8", 1 + 4 / (128 * 128), 2, 2, "fp8", head_bytes=2),
    # INT4 weight-only, group 128 with a 16-bit scale per group; the GEMM dequantises to bf16.
    "int4": Precision("int4", 0.5 + 2 / 128, 2, 2, "bf16", head_bytes=2),
    "fp8-kv": Precision("fp8-kv", 2, 2, 1, "bf16"),
    "int4+fp8-kv": Precision("int4+fp8-kv", 0.5 + 2 / 128, 2, 1, "bf16", head_bytes=2),
}


@dataclass(frozen=True)
class StepShape:
    """One flat batch: per sequence, its new tokens this step and its context length after it."""
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    precision: Precision = PRECISIONS["bf16"]
    num_sampled: int | None = None   # rows that compute logits (default: one per sequence)
    greedy: bool = True

    def __post_init__(self):
        if len(self.query_lens) != len(self.context_lens) or not self.query_lens:
            raise ValueError("step shape: query_lens and context_lens must be non-empty and of equal length")
        for q, c in zip(self.query_lens, self.context_lens):
            if not 1 <= q <= c:
                raise ValueError(f"step shape: need 1 <= query length <= context length, got {q} and {c}")

    @classmethod
    def prefill(cls, batch: int, prompt_len: int, precision: Precision = PRECISIONS["bf16"],
                greedy: bool = True) -> "StepShape":
        return cls((prompt_len,) * batch, (prompt_len,) * batch, precision, greedy=greedy)

    @classmethod
    def decode(cls, batch: int, context_len: int, precision: Precision = PRECISIONS["bf16"],
               greedy: bool = True) -> "StepShape":
        return cls((1,) * batch, (context_len,) * batch, precision, greedy=greedy)

    @classmethod
    def from_scheduler_output(cls, sched, precision: Precision, greedy: bool = True) -> "StepShape":
        """The shape of an engine step (`ridge.engine.scheduler.SchedulerOutput`)."""
        items = sched.scheduled
        return cls(tuple(i.num_new_tokens for i in items), tuple(i.start + i.num_new_tokens for i in items),
                   precision, num_sampled=sum(1 for i in items if i.samples), greedy=greedy)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def sampled_rows(self) -> int:
        return self.num_seqs if self.num_sampled is None else self.num_sampled

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for q in self.query_lens if q == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(q for q in self.query_lens if q > 1)


@dataclass(frozen=True)
class OpCost:
    name: str
    flops: float
    bytes: float            # minimum bytes moved, all operands
    weight_bytes: float     # of which parameters
    kv_bytes: float         # of which KV-cache reads and writes
    calls: int              # times the op runs in a step (once per layer for most)
    compute: str            # the matrix ceiling its FLOPs are held against

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else float("inf")


def attention_pairs(query_len: int, context_len: int, window: int | None = None) -> int:
    """(query row, key) pairs of one sequence under the causal mask: row at position p sees keys
    max(0, p - window + 1) .. p, i.e. min(p + 1, window) of them."""
    lo, hi = context_len - query_len + 1, context_len          # keys seen by the first / last row
    if window is None or hi <= window:
        return (lo + hi) * query_len // 2
    total = 0
    top = min(hi, window)
    if lo <= top:
        total += (lo + top) * (top - lo + 1) // 2
    total += window * (hi - max(lo, window + 1) + 1)
    return total


def attention_keys_read(query_len: int, context_len: int, window: int | None = None) -> int:
    """Distinct cached keys a sequence's rows read (the union of their windows)."""
    return context_len if window is None else min(context_len, query_len + window - 1)


def step_costs(cfg: ModelConfig, shape: StepShape) -> list[OpCost]:
    """Per-op FLOPs and bytes of one forward step (all layers), in `OPS` order."""
    p = shape.precision
    a, w, c, hb = p.act_bytes, p.weight_bytes, p.kv_bytes, p.lm_head_bytes
    T, N, L = shape.num_tokens, shape.sampled_rows, cfg.num_layers
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, K, q, kv, V = cfg.num_heads, cfg.num_kv_heads, cfg.q_size, cfg.kv_size, cfg.vocab_size
    act_roof = p.act_compute
    ops: list[OpCost] = []

    def gemm(name, m, n, k, bias, weight_elt, calls, roof):
        flops = 2 * m * n * k + (m * n if bias else 0)
        wbytes = (n * k * weight_elt + (n * a if bias else 0)) * calls
        ops.append(OpCost(name, flops * calls, wbytes + (m * k + m * n) * a * calls, wbytes, 0, calls, roof))

    ops.append(OpCost("embed", 0, 2 * T * h * a, T * h * a, 0, 1, act_roof))   # T rows of the table
    # 2L norms in the layers (layer 0's input norm has no residual yet), then the final norm
    # (final_norm below, its residual output never read, so not written)
    norm_flops = T * h * (NORM_FLOPS_PER_ELEMENT + (NORM_FLOPS_PER_ELEMENT + 1) * (2 * L - 1))
    norm_bytes = T * h * a * (2 + 4 * (2 * L - 1)) + 2 * L * h * a
    ops.append(OpCost("norm", norm_flops, norm_bytes, 2 * L * h * a, 0, 2 * L, act_roof))
    gemm("qkv_proj", T, q + 2 * kv, h, cfg.qkv_bias, w, L, p.compute)
    if cfg.qk_norm:
        rows = T * (H + K)
        ops.append(OpCost("qk_norm", NORM_FLOPS_PER_ELEMENT * rows * d * L, (2 * rows * d * a + 2 * d * a) * L,
                          2 * d * a * L, 0, 2 * L, act_roof))
    kv_written = T * 2 * kv * c * L
    # read q, k, v; write rotated q, k; the tables; the K/V rows into the cache
    ops.append(OpCost("rope_kv_write", ROTARY_FLOPS_PER_ELEMENT * T * (H + K) * d * L,
                      (T * (2 * q + 3 * kv) * a + T * d * ROPE_TABLE_BYTES) * L + kv_written, 0, kv_written, L,
                      act_roof))
    window = cfg.sliding_window
    pairs = sum(attention_pairs(ql, cl, window) for ql, cl in zip(shape.query_lens, shape.context_lens))
    keys = sum(attention_keys_read(ql, cl, window) for ql, cl in zip(shape.query_lens, shape.context_lens))
    kv_read = keys * 2 * kv * c * L
    ops.append(OpCost("attention", 4 * H * d * pairs * L, 2 * T * q * a * L + kv_read, 0, kv_read, L, p.compute))
    gemm("o_proj", T, h, q, cfg.o_bias, w, L, p.compute)
    gemm("gate_up_proj", T, 2 * inter, h, cfg.mlp_bias, w, L, p.compute)
    ops.append(OpCost("activation", ACTIVATION_FLOPS_PER_ELEMENT * T * inter * L, 3 * T * inter * a * L,
                      0, 0, L, act_roof))
    gemm("down_proj", T, h, inter, cfg.mlp_bias, w, L, p.compute)
    ops.append(OpCost("final_norm", (NORM_FLOPS_PER_ELEMENT + 1) * T * h, 3 * T * h * a + h * a, h * a, 0, 1,
                      act_roof))
    # The LM head: [N, h] x [h, V] -> float32 logits, for the sampled rows only.
    head_w = V * h * hb
    ops.append(OpCost("lm_head", 2 * N * h * V, head_w + N * h * a + N * V * LOGIT_BYTES, head_w, 0, 1,
                      p.compute if p.head_bytes is None else act_roof))
    per_logit = 1 if shape.greedy else RANDOM_SAMPLING_FLOPS_PER_LOGIT
    ops.append(OpCost("sampling", per_logit * N * V, N * V * LOGIT_BYTES, 0, 0, 1, "fp32"))
    return ops


def total(costs: list[OpCost]) -> tuple[float, float]:
    return sum(o.flops for o in costs), sum(o.bytes for o in costs)


def parameter_bytes(cfg: ModelConfig, precision: Precision) -> float:
    """Bytes the model's parameters occupy at this precision (the whole embedding table included)."""
    p = precision
    h, inter, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_layer = (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * inter) * p.weight_bytes
    per_layer += 2 * h * p.act_bytes + (2 * cfg.head_dim * p.act_bytes if cfg.qk_norm else 0)
    per_layer += ((cfg.q_size + 2 * cfg.kv_size) * p.act_bytes if cfg.qkv_bias else 0)
    per_layer += (h * p.act_bytes if cfg.o_bias else 0) + ((2 * inter + h) * p.act_bytes if cfg.mlp_bias else 0)
    total_bytes = L * per_layer + cfg.vocab_size * h * p.act_bytes + h * p.act_bytes
    if not cfg.tie_word_embeddings:
        total_bytes += cfg.vocab_size * h * p.lm_head_bytes
    return total_bytes


def kv_bytes_per_token(cfg: ModelConfig, precision: Precision) -> float:
    return 2 * cfg.num_layers * cfg.kv_size * precision.kv_bytes
