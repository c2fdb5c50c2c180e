"""Linear layers, including merged projections: QKV and gate/up are each one weight, so one GEMM
reads the activations once and the weight streams through in one pass. `shards` records where each
checkpoint tensor lands in it; the parameter's weight_loader narrows to it (ridge/layers/weights.py).

Small batches (decode): with at most GEMV_MAX_ROWS (8) rows of x a projection is a weight stream
(~2 FLOPs per weight element read): what matters is the fraction of copy bandwidth it reaches, in
as few launches as possible. cuBLAS picks split-K kernels there (two launches, partials + reduce,
for o_proj and down_proj) and falls well short of copy bandwidth on the square projections, so on
CUDA such inputs go to ridge's one-launch GEMV (ridge/kernels/gemv.py); the rest to F.linear.

`input_act` (e.g. SiluAndMul for the down projection) is applied to x first, or, for a single row
on the GEMV path, fused into the GEMV's K loop (no activation kernel, no [1, K] round trip) where
the activation names a GEMV act (`gemv_act`). The fusion pays only on the M = 1 FMA path: at M =
2-8 the GEMV's tensor-core path recomputes the activation per tile and loses to the separate
kernel (benchmarks/gemv.py). Same function on every path; only the fp32 summation order differs.

With a quantization method (`quant`, a QuantConfig from ridge/layers/quant/registry.py) the layer's
weights, their loading and its GEMM belong to the method's LinearMethod (ridge/layers/quant/base.py);
the Linear keeps its shards, bias and input activation, and states the quantized bytes in its cost.
Where the method's GEMM takes its input quantized (`takes_quantized_input(rows)`), the kernel
producing the input may quantize it on its way out: the input activation, or the norm before the
layer. `wire_producer` connects the two at build time where the producer's kernel writes the
format the method reads; the layer is then `fed_quantized`, takes a LinearInput from its producer
at every batch size, and states no quantization pass of its own where the producer quantizes.

Tensor parallelism (`tp`, ridge/parallel.py): a column-parallel layer holds this rank's rows of
each shard (`sources`: where they sit in the checkpoint tensor; an even split unless the caller
says otherwise, as attention does for KV heads copied onto several ranks), a row-parallel layer
this rank's share of the input columns, its partial outputs summed by one all-reduce. Its bias is
whole on every rank and added by rank 0 alone, inside the same GEMM, so the sum counts it once.
`in_features` / `out_features` are this rank's, and so is the cost the layer states (a row-parallel
layer's includes its all-reduce, ridge/layers/cost.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.kernels.gemv import GEMV_MAX_ROWS, gemv
from ridge.parallel import SINGLE, TensorParallel
from ridge.layers.quant.base import LinearInput, QuantConfig
from ridge.layers.weights import default_weight_loader, set_weight_loader
from ridge.layers.cost import (FP8_ACT, OpCost, Precision, StepShape, act_quant_cost, all_reduce_cost, gemm_cost,
                               precision_of)


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether Linear.forward sends x to ridge's GEMV rather than F.linear."""
    return x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype == weight.dtype


PARALLEL_KINDS = (None, "column", "row")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: dict[str, int] | int, bias: bool = False,
                 input_act: nn.Module | None = None, quant: QuantConfig | None = None, tp: TensorParallel = SINGLE,
                 parallel: str | None = None, slices: dict[str, tuple[int, int]] | None = None):
        """out_sizes: the checkpoint's rows of each shard. parallel: None (whole on every rank),
        "column" (this rank's rows of each shard: `slices`, shard -> (first row, rows), default
        the even split) or "row" (this rank's share of the input columns, outputs all-reduced)."""
        super().__init__()
        if parallel not in PARALLEL_KINDS:
            raise ValueError(f"parallel: must be one of {PARALLEL_KINDS}, got {parallel!r}")
        out_sizes = {"": out_sizes} if isinstance(out_sizes, int) else out_sizes
        self.tp, self.parallel = tp, parallel if tp.size > 1 else None
        self.full_sizes, self.full_in = dict(out_sizes), in_features
        self.sources: dict[str, tuple[int, int]] = {      # shard id -> (first row, rows) of the checkpoint's
            name: (slices or {}).get(name) or tp.split(size, f"a projection's {size} output rows")
            if self.parallel == "column" else (0, size) for name, size in out_sizes.items()}
        self.in_slice = tp.split(in_features, f"a projection's {in_features} input columns") \
            if self.parallel == "row" else (0, in_features)
        self.shards: dict[str, tuple[int, int]] = {}      # shard id -> (first row, rows) of this rank's
        offset = 0
        for name, (_, rows) in self.sources.items():
            self.shards[name], offset = (offset, rows), offset + rows
        self.in_features, self.out_features = self.in_slice[1], offset
        self.shard_ids = list(out_sizes) if len(out_sizes) > 1 else None
        self.fed_quantized = False      # a producer hands this layer its input (wire_producer)
        # the method registers the weights it stores (named as its checkpoint format's tensors)
        self.quant_method = quant.linear_method(self) if quant is not None else None
        if self.quant_method is None:
            self.weight = self.float_weight()
        self.bias = self._param(offset) if bias else None
        self.input_act = input_act
        if input_act is not None:
            wire_producer(input_act, self)

    def _param(self, *shape, device=None) -> nn.Parameter:
        return set_weight_loader(nn.Parameter(torch.empty(*shape, device=device), requires_grad=False),
                                 self.weight_loader, self.shard_ids)

    def float_weight(self, device=None) -> nn.Parameter:
        """A weight [out, in] in the model's dtype, loaded by weight_loader (device "meta": only a shape)."""
        return self._param(self.out_features, self.in_features, device=device)

    def num_weights(self) -> int:
        """Weights (and biases) this layer stands for, however they are stored: an INT4 layer's
        eight values a word, not its int32 words, scales and zero points."""
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def shard_slot(self, param: nn.Parameter, shard_id: str | None) -> tuple[int, int]:
        """(first row, rows) of the outputs a checkpoint tensor for `shard_id` fills."""
        if (shard_id is None) != (param.shard_ids is None) or (shard_id is not None and shard_id not in self.shards):
            raise ValueError(f"is shard {shard_id!r} of a parameter with shards {param.shard_ids}")
        return self.shards[shard_id] if shard_id is not None else (0, self.out_features)

    def rank_share(self, loaded: torch.Tensor, shard_id: str | None, out_dim: int | None = 0, out_per: int = 1,
                   in_dim: int | None = 1, in_per: int = 1) -> torch.Tensor:
        """This rank's part of a checkpoint tensor of shard_id: its outputs (column-parallel) or its
        inputs (row-parallel), whole for a layer that is not split. out_dim / in_dim: the tensor's
        dimension of outputs / inputs (None: it has none, e.g. a bias has no inputs: a row-parallel
        bias is whole, rank 0 adds it); out_per / in_per: how many outputs / inputs one element of
        that dimension stands for (8 in a packed int32 word, G in a group's scale)."""
        if self.parallel == "column" and out_dim is not None:
            full, (start, count) = self.full_sizes[shard_id or ""], self.sources[shard_id or ""]
            return self._cut(loaded, out_dim, out_per, full, start, count, "outputs")
        if self.parallel == "row" and in_dim is not None:
            return self._cut(loaded, in_dim, in_per, self.full_in, *self.in_slice, "inputs")
        return loaded

    def _cut(self, loaded: torch.Tensor, dim: int, per: int, full: int, start: int, count: int, what: str):
        if loaded.shape[dim] * per != full:
            raise ValueError(f"has {loaded.shape[dim] * per} {what}, expected {full} (split across "
                             f"{self.tp.size} tensor-parallel ranks)")
        if start % per or count % per:
            raise ValueError(f"cannot be split across {self.tp.size} tensor-parallel ranks: a rank's {count} "
                             f"{what} from {start} would cut a block of {per} (a packed word or a group)")
        return loaded.narrow(dim, start // per, count // per)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor (this rank's part of it) into param, or into its rows for
        shard_id of a merged layer."""
        rows = self.shard_slot(param, shard_id)
        loaded = self.rank_share(loaded, shard_id, in_dim=1 if loaded.dim() == 2 else None)
        default_weight_loader(param if shard_id is None else param.data.narrow(0, *rows), loaded)

    def finish_loading(self) -> None:
        """Called by the model loader once every tensor is in (INT4: the act-order permutation)."""
        if self.quant_method is not None:
            self.quant_method.finish_loading(self)

    def initialize_dummy(self, generator: torch.Generator, std: float) -> None:
        """Dummy weights (load_format "dummy"): normal(0, std), or the quantization method's own."""
        if self.quant_method is not None:
            self.quant_method.initialize_dummy(self, generator, std)
        else:
            self.weight.normal_(0.0, std, generator=generator)
        if self.bias is not None:
            self.bias.normal_(0.0, std, generator=generator)

    def takes_quantized_input(self, rows: int) -> bool:
        """Whether the GEMM for `rows` rows takes its input already quantized (its method's input_format)
        from the kernel producing it."""
        return self.quant_method is not None and self.quant_method.takes_quantized(rows)

    def fed_quantized_at(self, step: StepShape, rows: int) -> bool:
        """Whether, in this step's cost, the producer hands the input over quantized (what-if weight
        formats leave the activations as they are)."""
        return self.fed_quantized and step.weights is None and self.takes_quantized_input(rows)

    def permute_outputs(self, rows: torch.Tensor) -> None:
        """Reorder the output rows (a model's layout change at load), in whatever form the weight is stored."""
        if self.quant_method is not None:
            self.quant_method.permute_outputs(self, rows)
        else:
            self.weight.data.copy_(self.weight.data[rows.to(self.weight.device)])
        if self.bias is not None:
            self.bias.data.copy_(self.bias.data[rows.to(self.bias.device)])

    def forward(self, x):
        """input_act(x) @ weight^T (+ bias); x is a LinearInput where a producer feeds the layer;
        row-parallel: summed over the ranks."""
        bias = self.bias if self.parallel != "row" or self.tp.rank == 0 else None
        if self.quant_method is not None:
            if self.input_act is not None:
                x = self.input_act.produce(x, self) if self.fed_quantized else self.input_act(x)
            if not self.fed_quantized:
                y = self.quant_method.apply(self, x, bias)
            elif x.quantized is not None:
                y = self.quant_method.apply_quantized(self, x, bias)
            else:
                y = self.quant_method.apply(self, x.float, bias)
        else:
            gemv_path = uses_gemv(x, self.weight)
            act = self.input_act.gemv_act if self.input_act is not None else None
            if self.input_act is not None and not (gemv_path and x.shape[0] == 1 and act is not None):
                x, act = self.input_act(x), None
            y = gemv(x, self.weight, bias, act=act) if gemv_path else F.linear(x, self.weight, bias)
        return self.tp.all_reduce(y) if self.parallel == "row" else y

    def weight_precision(self, step: StepShape, rows: int | None = None) -> Precision:
        """The step's what-if format, else its own for `rows` rows: INT4 with its group scales, FP8
        blocks (or bf16 where its dispatch runs the bf16 weight), or its dtype."""
        if step.weights is not None:
            return step.weights
        rows = step.num_tokens if rows is None else rows
        return self.quant_method.precision(step.act, rows) if self.quant_method is not None else \
            precision_of(self.weight.dtype)

    def cost(self, step: StepShape, rows: int | None = None, out_bytes: float | None = None,
             name: str = "linear") -> list[OpCost]:
        """One GEMM over `rows` (default: every token of the step), `out_bytes` an output element;
        the input activation's ops first (they run inside this forward, or inside the GEMV), then a
        pass the quantization method runs on the weight first (INT4's dequant path). An FP8
        GEMM reads FP8_ACT; the quantization pass before it is its own op unless the producer
        fused it (then the producer writes FP8_ACT instead of the activation dtype). Row-parallel:
        the all-reduce of the partial sums after it."""
        rows = step.num_tokens if rows is None else rows
        quant_in = step.weights is None and self.quant_method is not None and self.quant_method.quantizes_input(rows)
        fed = quant_in and self.fed_quantized_at(step, rows)
        ops = self.input_act.cost(step, self.in_features, quantized_out=fed) if self.input_act is not None else []
        if quant_in and not fed:
            ops.append(act_quant_cost(rows, self.in_features, step))
        w = self.weight_precision(step, rows)
        gemm = gemm_cost(name, rows, (self.out_features, self.in_features), self.bias, w, step, out_bytes,
                         in_bytes=FP8_ACT.bytes if quant_in else None)
        if self.quant_method is not None and step.weights is None and \
                (before := self.quant_method.weight_pass(self, step, rows)):
            ops += before                       # it writes the weight the GEMM reads: not a parameter there
            gemm.param_bytes -= self.out_features * self.in_features * w.bytes
        return ops + [gemm] \
            + (all_reduce_cost(f"{name}.all_reduce", rows, self.out_features, step, self.tp.size)
               if self.parallel == "row" else [])


def wire_producer(producer: nn.Module, consumer: Linear) -> None:
    """Hand `consumer` its input from `producer` (a norm before it, or its own input activation)
    quantized where its method's GEMM takes it: only where the producer's kernel writes the format
    the method reads (`output_formats`), decided once, at build. A wired producer's `produce(x,
    consumer)` returns a LinearInput at every batch size."""
    method = consumer.quant_method
    if method is not None and method.input_format is not None and method.input_format in producer.output_formats:
        consumer.fed_quantized = True
        # held, not registered: the consumer belongs to its block (as a child of the producer its
        # weights would be listed twice)
        object.__setattr__(producer, "consumer", consumer)
