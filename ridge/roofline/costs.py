"""The cost of a step is what the model's modules say it is: the model is built on the meta device
(no weights, no memory) and asked for `cost(step)`; the roofline adds nothing of its own. The one
place MBU and MFU are computed is `utilization`.

PRECISIONS are the formats the prediction grid asks about: the activations' dtype, plus what-if
storage of the projections' weights and of the KV cache (the layers apply them to their own
tensors; the LM head keeps the model's dtype).

`RankShare(cfg, N)` stands for rank 0's share of the model under tensor parallelism of size N:
its meta model is built with a TensorParallel of size N and no process group (the layers only
split their shapes; nothing communicates on the meta device), so its cost is that rank's slices
plus the collectives its forward runs (ridge/layers/cost.py). Wherever a function here takes a
ModelConfig it takes a RankShare too."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ridge.config import ModelConfig
from ridge.layers.cost import OpCost, Precision, StepShape, precision_of


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype = torch.bfloat16
    weights: Precision | None = None     # None: as the model's dtype
    kv_bytes: float | None = None        # None: as the model's dtype

    @property
    def compute(self) -> str:
        """The matrix ceiling the projections run against."""
        return (self.weights or precision_of(self.dtype)).compute

    def shape(self, step: StepShape) -> StepShape:
        return replace(step, dtype=self.dtype, weights=self.weights, kv_bytes=self.kv_bytes)


# INT4 weight-only, group 128 with a 16-bit scale a group (the GEMM dequantises to bf16); FP8
# weights with one float32 scale a 128x128 block, on FP8 tensor cores
INT4 = Precision("int4", 0.5 + 2 / 128, "bf16")
FP8 = Precision("fp8", 1 + 4 / (128 * 128), "fp8")
PRECISIONS = {f.name: f for f in (
    Format("bf16"), Format("fp16", torch.float16), Format("fp32", torch.float32), Format("fp8", weights=FP8),
    Format("int4", weights=INT4), Format("fp8-kv", kv_bytes=1), Format("int4+fp8-kv", weights=INT4, kv_bytes=1))}


def format_of(dtype: torch.dtype) -> Format:
    return PRECISIONS[precision_of(dtype).name]


@dataclass(frozen=True)
class RankShare:
    """Rank 0's share of `cfg` under tensor parallelism of size `tp_size` (see the module docstring)."""
    cfg: ModelConfig
    tp_size: int = 1

    def __post_init__(self):
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size: must be a positive integer, got {self.tp_size!r}")
        if self.tp_size > 1 and self.cfg.mla is not None:
            raise ValueError("tensor_parallel_size: latent attention (DeepSeek) does not run tensor-parallel yet")


def meta_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp_size: int = 1) -> torch.nn.Module:
    """The model's module tree in `dtype` on the meta device: shapes and dtypes, no storage; with
    tp_size > 1 rank 0's share of it (a TensorParallel of that size and no process group)."""
    from ridge.layers.attention import TORCH_BACKEND
    from ridge.models.registry import model_class
    from ridge.parallel import SINGLE, TensorParallel

    key = (repr(cfg), dtype, tp_size)
    if key not in _META:
        default = torch.get_default_dtype()
        tp = SINGLE if tp_size == 1 else TensorParallel(0, tp_size)
        try:
            torch.set_default_dtype(dtype)
            with torch.device("meta"):
                _META[key] = model_class(cfg.architecture)(cfg, TORCH_BACKEND, cfg.max_position_embeddings, tp)
        finally:
            torch.set_default_dtype(default)
    return _META[key]


_META: dict = {}


def model_of(model_or_cfg, dtype: torch.dtype) -> torch.nn.Module:
    """A module with cost(): the model itself, or the meta model of a ModelConfig or RankShare."""
    if isinstance(model_or_cfg, RankShare):
        return meta_model(model_or_cfg.cfg, dtype, model_or_cfg.tp_size)
    return meta_model(model_or_cfg, dtype) if isinstance(model_or_cfg, ModelConfig) else model_or_cfg


def op_costs(model, step: StepShape) -> list[OpCost]:
    """Every op of the step as the modules state it (one per module call), in order. `model`: a
    module with `cost(step)` or a ModelConfig (its meta model in the step's dtype)."""
    return model_of(model, step.dtype).cost(step)


def merge(costs: list[OpCost]) -> list[OpCost]:
    """One op per name (first-seen order), FLOPs, bytes and calls summed; the first one's module."""
    out: dict[str, OpCost] = {}
    for c in costs:
        o = out.get(c.name)
        if o is None:
            out[c.name] = replace(c)
        else:
            o.flops, o.bytes, o.calls = o.flops + c.flops, o.bytes + c.bytes, o.calls + c.calls
            o.param_bytes, o.kv_bytes = o.param_bytes + c.param_bytes, o.kv_bytes + c.kv_bytes
            o.link_bytes += c.link_bytes
            if c.expert_load is not None and (o.expert_load is None or imbalance(c) > imbalance(o)):
                o.expert_load = c.expert_load
    return list(out.values())


def imbalance(c: OpCost) -> float:
    """The busiest expert's pairs over the mean (1: an even load); 0 without a known load."""
    return c.expert_load[0] / c.expert_load[1] if c.expert_load is not None and c.expert_load[1] else 0.0


def step_costs(model, step: StepShape) -> list[OpCost]:
    """One row per op name, summed over the layers."""
    return merge(op_costs(model, step))


def prefill_shape(batch: int, prompt_len: int, **kw) -> StepShape:
    """`batch` whole prompts of `prompt_len` tokens."""
    return StepShape((prompt_len,) * batch, (prompt_len,) * batch, **kw)


def decode_shape(batch: int, context_len: int, **kw) -> StepShape:
    """`batch` sequences adding one token each, at context `context_len`."""
    return StepShape((1,) * batch, (context_len,) * batch, **kw)


ONE_TOKEN = StepShape((1,), (1,))


def parameter_bytes(model, step: StepShape = ONE_TOKEN) -> float:
    """Bytes the parameters occupy (the whole embedding table included): what a one-token decode
    reads, each parameter once, plus the embedding rows it does not look up. `step` gives the
    dtype of a ModelConfig's meta model and any what-if weight format."""
    m = model_of(model, step.dtype)
    costs = m.cost(replace(step, query_lens=(1,), context_lens=(1,), num_sampled=1))
    table = m.model.embed_tokens.weight
    tables = 0 if m.cfg.tie_word_embeddings else table.numel() * table.element_size()
    return sum(c.param_bytes for c in costs if c.kind != "embedding") + tables


def kv_bytes_per_token(model, step: StepShape = ONE_TOKEN) -> float:
    """A one-token step at context 1 writes one token's K/V and reads it back."""
    costs = op_costs(model, replace(step, query_lens=(1,), context_lens=(1,), num_sampled=1))
    return sum(c.kv_bytes for c in costs) / 2


def utilization(costs: list[OpCost], seconds: float, ceilings) -> tuple[float, float]:
    """(MFU, MBU) of ops that took `seconds`. MFU: the time the ops' FLOPs take at their matrix
    peaks, each op at its own (FP8 projections at the FP8 roof, attention at bf16's), over
    `seconds` (a step of one precision: its FLOPs over that peak); MBU: their minimum bytes
    (weights + KV + activations) over the measured bandwidth. The only place either is computed.
    Tensor-parallel costs are one rank's: its GPU's MFU and MBU (collectives add no FLOPs or HBM
    bytes, only time)."""
    if seconds <= 0:
        raise ValueError(f"seconds: must be > 0, got {seconds}")
    at_peak = sum(c.flops / ceilings.peak(c.compute) for c in costs if c.flops)
    nbytes = sum(c.bytes for c in costs)
    mfu = at_peak / seconds
    mbu = nbytes / seconds / ceilings.bandwidth
    return mfu, mbu


def matrix_compute(step: StepShape) -> str:
    """The matrix ceiling a step's projections run against: the one its MFU is held to."""
    return (step.weights or step.act).compute


def step_shape(sched, dtype: torch.dtype, greedy: bool = True, kv_bytes: float | None = None) -> StepShape:
    """The shape of an engine step (`ridge.engine.scheduler.SchedulerOutput`); kv_bytes: bytes per
    cached K/V element when the cache is not in the model dtype (an FP8 cache: 1 + its scale's share)."""
    items = sched.scheduled
    return StepShape(tuple(i.num_new_tokens for i in items), tuple(i.start + i.num_new_tokens for i in items),
                     num_sampled=sum(1 for i in items if i.samples), greedy=greedy, dtype=dtype, kv_bytes=kv_bytes)
