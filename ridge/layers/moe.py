"""The experts of a mixture-of-experts block, with their routing: `FusedMoE(logits, x)`.

All experts of a layer are two parameters, `w13_weight` [E, 2I, H] (each expert's gate rows, then
its up rows: the dense merged gate/up projection, per expert) and `w2_weight` [E, H, I], so one
kernel launch serves every expert and indexes the weights by expert id (ridge/kernels/moe_gemm.py).
Checkpoints store one matrix per expert and projection; each is one shard of the merged
parameter (`"<expert>.gate"`, `"<expert>.up"`, `"<expert>"` for down), placed by the parameter's
weight_loader like any merged projection's.

Quantized experts (`quant`, the model's quantization method: its ExpertsMethod,
ridge/layers/quant/base.py): weight-only, and the kernels dequantize tiles in registers
(ridge/kernels/moe_quant.py): decode, where MoE spends its time at serving batch sizes, streams
the experts' bytes. The method says what the parameters hold (float weights it quantizes once
loaded, or a checkpoint's stored format: `stores_checkpoint_format`, whose loaders take the
checkpoint's StoredWeights whole) and what the kernels get once loading finishes.

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

from ridge.kernels.moe_gemm import fused_moe_grouped, fused_moe_ref, fused_moe_small
from ridge.kernels.moe_route import route_grouped_ref, route_topk, route_topk_ref
from ridge.layers.cost import OpCost, StepShape
from ridge.layers.quant.base import QuantConfig, StoredWeight
from ridge.layers.weights import default_weight_loader, set_weight_loader
from ridge.parallel import SINGLE, TensorParallel


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, expert_size: int, renormalize: bool,
                 grouped=None, tp: TensorParallel = SINGLE, quant: QuantConfig | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.grouped = grouped      # DeepSeek's routing (ridge.model_config.GroupedRouting), else softmax top-k
        # expert_size: this rank's share of each expert's intermediate columns (first: `first`)
        self.tp, (self.first, expert_size) = tp, tp.split(expert_size, "each expert's intermediate size")
        self.hidden_size, self.expert_size = hidden_size, expert_size
        self.dtype = torch.get_default_dtype()          # the model's (the loader builds under it)
        self.quant = quant.experts_method(self) if quant is not None else None
        self.w13_quant = self.w2_quant = None          # the kernels' quantized experts, once loaded
        experts = range(num_experts)
        store = dict(dtype=self.quant.param_dtype(self.dtype)) if self.quant is not None else {}
        takes_stored = self.stores_checkpoint_format
        self.w13_weight = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size, **store), requires_grad=False),
            self.weight_loader, [f"{e}.{part}" for e in experts for part in ("gate", "up")], takes_stored)
        self.w2_weight = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, hidden_size, expert_size, **store), requires_grad=False),
            self.weight_loader, [str(e) for e in experts], takes_stored)
        if self.quant is not None:
            self.quant.create_weights(self)
        self.plan = None            # MoePlan on CUDA, measured at load
        self.max_step_tokens: int | None = None     # the engine's step budget: larger batches are not tuned
        self.routed: torch.Tensor | None = None

    @property
    def stores_checkpoint_format(self) -> bool:
        """Whether the parameters hold a checkpoint's stored format (its StoredWeights load whole)."""
        return self.quant is not None and self.quant.stores_checkpoint_format

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | StoredWeight, shard_id: str | None = None
                      ) -> None:
        """One expert's gate, up or down matrix (this rank's rows or columns of it) into its place in
        the merged parameter; a stored format's values go there too, its scales where the method keeps them."""
        if shard_id not in param.shard_ids:
            raise ValueError(f"is shard {shard_id!r} of an expert parameter with shards "
                             f"0..{self.num_experts - 1} (gate/up or down)")
        expert, _, part = shard_id.partition(".")
        dst, inter, dim = param.data[int(expert)], self.expert_size, 0 if part else 1
        stored = isinstance(loaded, StoredWeight)
        if self.stores_checkpoint_format != stored:
            raise ValueError(f"is {'a stored quantized weight' if stored else 'a float weight'}, and these experts "
                             f"hold {'the checkpoint format as stored' if not stored else 'float weights'}")
        q = loaded.q if stored else loaded
        if q.dim() != 2 or q.shape[dim] != inter * self.tp.size:
            raise ValueError(f"has shape {tuple(q.shape)}, expected {inter * self.tp.size} "
                             f"{'rows' if part else 'columns'} (the expert's intermediate size)")
        if part:
            dst = dst.narrow(0, 0 if part == "gate" else inter, inter)
        default_weight_loader(dst, q.narrow(dim, self.first, inter))
        if stored:
            self.quant.load_stored(self, part, int(expert), loaded)

    def finish_loading(self) -> None:
        # quantized once (the float copies may be gone); a stored format's experts are views of the parameters
        if self.quant is not None and (self.w13_quant is None or self.stores_checkpoint_format):
            self.w13_quant, self.w2_quant = self.quant.finish_loading(self)
        w13, w2 = self.weights()
        if w13.device.type == "cuda":
            from ridge.layers.moe_tuning import moe_plan
            self.plan = moe_plan(w13, w2, self.top_k, self.max_step_tokens)

    def weights(self):
        """(w13, w2) as the kernels take them: float tensors, or the method's quantized experts."""
        return (self.w13_quant, self.w2_quant) if self.quant else (self.w13_weight.data, self.w2_weight.data)

    def initialize_dummy(self, generator: torch.Generator, std: float) -> None:
        if self.quant is not None and self.w13_quant is not None and not self.stores_checkpoint_format:
            raise RuntimeError("FusedMoE: quantized experts are quantized once, after the weights are in place")
        if self.quant is not None:
            self.quant.initialize_dummy(self, generator, std)
        else:
            for w in (self.w13_weight, self.w2_weight):
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
        """Bytes an expert weight: the method's (its scales' share included), else the float dtype's."""
        if self.quant is not None:
            return self.quant.weight_bytes(self.dtype)
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
