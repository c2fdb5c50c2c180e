"""The experts of a mixture-of-experts block, with their routing: `FusedMoE(logits, x)`.

All experts of a layer are two parameters, `w13_weight` [E, 2I, H] (each expert's gate rows, then
its up rows: the dense merged gate/up projection, per expert) and `w2_weight` [E, H, I], so one
kernel launch serves every expert and indexes the weights by expert id (ridge/kernels/moe_gemm.py).
Checkpoints store one matrix per expert and projection; each is one shard of the merged
parameter (`"<expert>.gate"`, `"<expert>.up"`, `"<expert>"` for down), placed by the parameter's
weight_loader like any merged projection's.

Quantized experts (`quant`, the quantization setting: "fp8" or "int4"): each expert's matrices are
quantized at load, weight-only, and the kernels dequantize tiles in registers
(ridge/kernels/moe_quant.py): decode, where MoE spends its time at serving batch sizes, streams
the experts' bytes. FP8: e4m3 with a scale per 128 x 128 block, the HF fp8 format's. INT4: round
to nearest, asymmetric, a scale and zero point per group of 128 inputs, as the dense INT4 layers
quantize at load. An FP8 checkpoint whose experts come in 128 x 128 blocks (DeepSeek-V3's;
`fp8_blocks`) is kept as stored, whatever the setting: the parameters hold e4m3, their loaders
take the checkpoint's blocks and scales (Fp8BlockWeight), and the kernels compute exactly the
dequantized model's products. Where an expert's intermediate share does not fall on block
boundaries the blocks are dequantized at load instead (and quantized again under "fp8").

On CUDA the step's routing runs in one kernel (softmax + top-k), then the path and tiles measured
fastest for this many tokens (ridge/layers/moe_tuning.py): the small-batch expert GEMVs or the
grouped GEMM over the pairs aligned by expert. Every kernel has fixed-size outputs for a given
token count, so a decode step's CUDA graph holds the whole path, expert choice included. On a CPU
the torch references run.

Cost: the experts' weights are read once a step per *distinct* expert the step selects, and
their FLOPs are those of the routed (token, expert) pairs. The layer keeps the last step's
expert choice (`routed`, the kernels' own output tensor: no copy, no sync) so that a cost stated
after a measured step counts the experts actually touched and can report the load per expert;
without one it assumes uniform routing.

Tensor parallelism (`tp`): each rank holds every expert's share of the intermediate dimension
(its rows of gate and up, its columns of down), so the routing and the kernels run unchanged on
narrower experts and the partial outputs are summed by one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.int4_matmul import PACK
from ridge.kernels.moe_gemm import fused_moe_grouped, fused_moe_ref, fused_moe_small
from ridge.kernels.moe_quant import FP8_BLOCK, INT4_GROUP, Fp8Experts, Int4Experts
from ridge.kernels.moe_route import route_grouped_ref, route_topk, route_topk_ref
from ridge.layers.cost import OpCost, StepShape
from ridge.layers.quant.formats import pack_last, quantize_rtn
from ridge.layers.quant.fp8 import Fp8BlockWeight, quantize_fp8_block
from ridge.layers.weights import default_weight_loader, set_weight_loader
from ridge.parallel import SINGLE, TensorParallel


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, expert_size: int, renormalize: bool,
                 grouped=None, fp8: bool = False, tp: TensorParallel = SINGLE, quant: str | None = None,
                 fp8_blocks: bool = False):
        super().__init__()
        if quant not in (None, "fp8", "int4"):
            raise ValueError(f"FusedMoE: quant must be None, 'fp8' or 'int4', got {quant!r}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.grouped = grouped      # DeepSeek's routing (ridge.model_config.GroupedRouting), else softmax top-k
        # expert_size: this rank's share of each expert's intermediate columns (first: `first`)
        self.tp, (self.first, expert_size) = tp, tp.split(expert_size, "each expert's intermediate size")
        self.hidden_size, self.expert_size = hidden_size, expert_size
        self.dtype = torch.get_default_dtype()          # the model's (the loader builds under it)
        # an FP8 checkpoint's 128 x 128 blocks kept as stored, where this rank's share is whole blocks
        self.fp8_blocks = fp8_blocks and expert_size % FP8_BLOCK == 0 and self.first % FP8_BLOCK == 0
        self.quant = "fp8" if fp8 or self.fp8_blocks else quant
        self.w13_quant = self.w2_quant = None          # Fp8Experts / Int4Experts once loaded
        experts = range(num_experts)
        store = dict(dtype=torch.float8_e4m3fn) if self.fp8_blocks else {}
        self.w13_weight = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size, **store), requires_grad=False),
            self.weight_loader, [f"{e}.{part}" for e in experts for part in ("gate", "up")])
        self.w2_weight = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, hidden_size, expert_size, **store), requires_grad=False),
            self.weight_loader, [str(e) for e in experts])
        if self.fp8_blocks:
            h = -(-hidden_size // FP8_BLOCK)
            self.register_buffer("w13_scale", torch.ones(num_experts, 2 * expert_size // FP8_BLOCK, h,
                                                         dtype=torch.float32))
            self.register_buffer("w2_scale", torch.ones(num_experts, h, expert_size // FP8_BLOCK, dtype=torch.float32))
            self.w13_weight.takes_fp8_blocks = self.w2_weight.takes_fp8_blocks = True
        self.plan = None            # MoePlan on CUDA, measured at load
        self.max_step_tokens: int | None = None     # the engine's step budget: larger batches are not tuned
        self.routed: torch.Tensor | None = None

    fp8 = property(lambda self: self.quant == "fp8")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """One expert's gate, up or down matrix (this rank's rows or columns of it) into its place in
        the merged parameter."""
        if shard_id not in param.shard_ids:
            raise ValueError(f"is shard {shard_id!r} of an expert parameter with shards "
                             f"0..{self.num_experts - 1} (gate/up or down)")
        expert, _, part = shard_id.partition(".")
        dst, inter, dim = param.data[int(expert)], self.expert_size, 0 if part else 1
        blocks = isinstance(loaded, Fp8BlockWeight)
        if self.fp8_blocks != blocks:
            raise ValueError(f"is {'an FP8 block weight' if blocks else 'a float weight'}, and these experts hold "
                             f"{'the FP8 checkpoint blocks as stored' if self.fp8_blocks else 'float weights'}")
        q = loaded.q if blocks else loaded
        if q.dim() != 2 or q.shape[dim] != inter * self.tp.size:
            raise ValueError(f"has shape {tuple(q.shape)}, expected {inter * self.tp.size} "
                             f"{'rows' if part else 'columns'} (the expert's intermediate size)")
        if part:
            dst = dst.narrow(0, 0 if part == "gate" else inter, inter)
        default_weight_loader(dst, q.narrow(dim, self.first, inter))
        if blocks:          # the scales of this rank's whole blocks, at the same place
            scale = (self.w13_scale if part else self.w2_scale)[int(expert)]
            if part:
                scale = scale.narrow(0, 0 if part == "gate" else inter // FP8_BLOCK, inter // FP8_BLOCK)
            b = FP8_BLOCK
            scale.copy_(loaded.scale.narrow(dim, self.first // b, inter // b))

    def finish_loading(self) -> None:
        if self.fp8_blocks:
            self.w13_quant, self.w2_quant = (Fp8Experts(w.data, s, self.dtype) for w, s in
                                             ((self.w13_weight, self.w13_scale), (self.w2_weight, self.w2_scale)))
        elif self.quant is not None and self.w13_quant is None:     # the float copies go: the kernels read these
            quantize = quantize_experts if self.quant == "fp8" else quantize_experts_int4
            self.w13_quant, self.w2_quant = (quantize(w.data) for w in (self.w13_weight, self.w2_weight))
            for w in (self.w13_weight, self.w2_weight):
                w.data = w.data.new_empty(0)
        w13, w2 = self.weights()
        if w13.device.type == "cuda":
            from ridge.layers.moe_tuning import moe_plan
            self.plan = moe_plan(w13, w2, self.top_k, self.max_step_tokens)

    def weights(self):
        """(w13, w2) as the kernels take them: float tensors, Fp8Experts or Int4Experts."""
        return (self.w13_quant, self.w2_quant) if self.quant else (self.w13_weight.data, self.w2_weight.data)

    w13_fp8 = property(lambda self: self.w13_quant if self.fp8 else None)

    def initialize_dummy(self, generator: torch.Generator, std: float) -> None:
        if self.quant and self.w13_quant is not None and not self.fp8_blocks:
            raise RuntimeError("FusedMoE: quantized experts are quantized once, after the weights are in place")
        for w, scale in ((self.w13_weight, "w13_scale"), (self.w2_weight, "w2_scale")):
            if self.fp8_blocks:         # random float experts in the checkpoint's blocks
                f = torch.empty(w.shape, dtype=self.dtype, device=w.device).normal_(0.0, std, generator=generator)
                q = quantize_experts(f)
                w.data.copy_(q.q)
                getattr(self, scale).copy_(q.scale)
            else:
                w.normal_(0.0, std, generator=generator)
        self.finish_loading()

    def forward(self, router_logits: torch.Tensor, x: torch.Tensor, score_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """router_logits [T, E], x [T, H] -> sum over each token's top_k experts of weight * expert(x)."""
        w13, w2 = self.weights()
        if self.grouped is not None:
            weights, experts = route_grouped_ref(router_logits, self.top_k, self.renormalize, self.grouped, score_bias)
        elif x.is_cuda:
            weights, experts = route_topk(router_logits, self.top_k, self.renormalize)
        else:
            weights, experts = route_topk_ref(router_logits, self.top_k, self.renormalize)
        self.routed = experts
        if not x.is_cuda:
            out = fused_moe_ref(x, w13, w2, weights, experts)
        elif (choice := self.plan.choice(x.shape[0]))[0] == "small":
            out = fused_moe_small(x, w13, w2, weights, experts, choice[1])
        else:
            out = fused_moe_grouped(x, w13, w2, weights, experts, choice[1], fuse_sum=choice[0] == "grouped")
        return self.tp.all_reduce(out)

    def tokens_per_expert(self, num_tokens: int) -> list[int] | None:
        """The last step's pairs per expert, if its expert choice is kept and was for num_tokens."""
        r = self.routed
        if r is None or r.shape[0] != num_tokens:
            return None
        return torch.bincount(r.reshape(-1).long().cpu(), minlength=self.num_experts).tolist()

    def num_weights(self) -> int:
        """The experts' weights (this rank's share), however they are stored."""
        return self.num_experts * 3 * self.expert_size * self.hidden_size

    def weight_bytes(self) -> float:
        """Bytes an expert weight: 1 in FP8 plus its block's fp32 scale shared by 128 x 128 weights;
        0.5 in INT4 plus its group's scale and zero point (the model's dtype) shared by 128; else
        the float dtype's."""
        if self.quant == "fp8":
            return 1 + 4 / FP8_BLOCK ** 2
        if self.quant == "int4":
            return 0.5 + 2 * torch.empty(0, dtype=self.dtype).element_size() / INT4_GROUP
        return self.w13_weight.element_size()

    def cost(self, step: StepShape) -> list[OpCost]:
        """Routing (softmax + top-k over [T, E] logits), then the experts: gate/up with SiLU-and-mul,
        down with the routing weight and the top-k sum (one op: one forward runs them). Weights
        of the distinct experts the step selects (the last step's choice when it had this many
        tokens, else the uniform-routing expectation); FLOPs of the T * top_k routed pairs."""
        T, E, k, H, inter = step.num_tokens, self.num_experts, self.top_k, self.hidden_size, self.expert_size
        a, w = step.act.bytes, self.weight_bytes()
        counts = self.tokens_per_expert(T)
        distinct = sum(1 for c in counts if c) if counts is not None else E * (1 - (1 - k / E) ** T)
        pairs = T * k
        route = OpCost("moe_route", "elementwise", 6 * T * E, T * E * 4 + pairs * 8, compute=step.act.compute)
        params = distinct * 3 * inter * H * w
        flops = 2 * pairs * 3 * inter * H + 5 * pairs * inter + 2 * pairs * H
        moved = params + 2 * T * H * a + 2 * pairs * inter * a       # x in, the output, h written and read
        if self.plan is not None and self.plan.choice(T)[0] != "small":
            moved += 2 * pairs * H * a      # the grouped down GEMM's weighted rows, written and summed
        load = (max(counts), pairs / E, counts.count(0)) if counts is not None else None
        return [route, OpCost("moe_experts", "gemm", flops, moved, params, compute=step.act.compute, expert_load=load)]


def quantize_experts(w: torch.Tensor) -> Fp8Experts:
    """Float experts [E, N, K] -> e4m3 values and 128 x 128 block scales, expert by expert."""
    q, scale = zip(*(quantize_fp8_block(w[e]) for e in range(w.shape[0])))
    return Fp8Experts(torch.stack(q), torch.stack(scale), w.dtype)


def quantize_experts_int4(w: torch.Tensor) -> Int4Experts:
    """Float experts [E, N, K] (K a multiple of 8) -> INT4 codes packed along K, scales and zero points
    per group of 128 inputs in w's dtype: min-max round to nearest (ridge/layers/quant/formats.py, the
    dense layers' grid, whose short last group is quantized padded with zeros), expert by expert."""
    E, N, K = w.shape
    if K % PACK:
        raise ValueError(f"INT4 experts: {K} inputs (w [E={E}, N={N}, K={K}]) are not a multiple of {PACK}, the "
                         f"codes an int32 word packs")
    q, scale, zero = [], [], []
    for e in range(E):
        qe, se, ze = quantize_rtn(w[e], INT4_GROUP, scale_dtype=w.dtype)
        q.append(pack_last(qe))
        scale.append(se)
        zero.append(ze.to(w.dtype))
    return Int4Experts(torch.stack(q), torch.stack(scale), torch.stack(zero), K)
