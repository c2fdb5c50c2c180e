"""INT4 weight-only linear layers (W4A16): the layer's tables, how they load, run and cost.

`Int4Linear` is a Linear's INT4 path (vLLM's LinearMethod). It registers one parameter per
checkpoint tensor of its format, under the checkpoint's name, so the model loader dispatches by
name as for any weight (merged q/k/v and gate/up shards included); but each parameter holds
ridge's table (ridge/kernels/int4_matmul.py: qweight [K / 8, N] packed along K, scales and zeros
[ceil(K / G), N] in the activation dtype), and its weight_loader converts the checkpoint's tensor into
the shard's columns as it arrives: nothing is held twice. Only the act-order permutation needs
every tensor of a layer, so it waits for `finish_loading` (called by the loader at the end). The
LM head and embeddings stay in the activation dtype (configs list lm_head as not converted).
A group size that does not divide K (DeepSeek-V2-Lite's dense down projection, K = 10944 at G =
128) leaves a short last group with its own table row, as AutoGPTQ and compressed-tensors store it;
a checkpoint tensor of any other group count is refused by shape. A tensor-parallel rank's share of
a checkpoint's groups must be whole groups; quantized at load ('int4'), each rank quantizes its own
share, so its last group may be short.

Weight bytes: 0.5 per weight, plus a scale and a zero point in the activation dtype per group of
G inputs: 0.5 + 4 / 128 bytes at G = 128 in bf16, 3.8x fewer than bf16 (the cost model counts it).
A batch whose bucket measured faster with the weight dequantized to 16 bits and cuBLAS takes that
path (ridge/layers/quant/int4/dispatch.py; a prefill's large batches); its cost is then the
dequant pass (weight_pass) and a GEMM reading the 16-bit weight.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn

from ridge.kernels.int4_matmul import PACK, group_size_error, groups_of, int4_matmul, pack_int4, unpack_int4
from ridge.layers.cost import OpCost, Precision, StepShape
from ridge.layers.quant.base import LinearMethod
from ridge.layers.quant.int4 import formats
from ridge.layers.quant.int4.config import Int4Config
from ridge.layers.quant.int4.dispatch import DequantWorkspace, dequant_matmul, dispatch_table, path_for
from ridge.layers.weights import set_weight_loader

DUMMY_SCALE = 0.02 / 8                    # (q - 8) * scale has about the std of a bf16 dummy weight


class Int4Linear(LinearMethod):
    """A Linear's INT4 tables and how they load, run and cost (the Linear passes itself in)."""

    def __init__(self, config: Int4Config, layer: nn.Module):
        self.config = config
        self.group_size = config.group_for(layer.in_features)
        self.paths: dict[int, str] | None = None    # batch bucket -> "int4" / "dequant" (int4/dispatch.py)
        self.workspace: DequantWorkspace | None = None      # the dequant path's 16-bit weight
        self.names: dict[str, str] = {}

    def create_weights(self, layer: nn.Module) -> None:
        """One parameter per checkpoint tensor of the format, under its name, each loading into ridge's table."""
        config, fmt = self.config, self.config.format
        k, n = layer.in_features, layer.out_features
        if layer.parallel == "row" and (config.group_size == -1 or config.desc_act):
            groups = "act-order (desc_act) groups" if config.desc_act else "one group of all inputs"
            raise ValueError(f"quantization_config: {groups} cannot be split across {layer.tp.size} tensor-parallel "
                             f"ranks (each holds a share of the inputs); load it with tensor_parallel_size 1")
        g = self.group_size
        field = (f"quantization: 'int4' (group size {g})" if fmt == "int4"
                 else f"quantization_config.group_size: {config.group_size}")
        share = f" (its share on each of {layer.tp.size} tensor-parallel ranks)" if layer.parallel == "row" else ""
        if k % PACK:
            raise ValueError(f"quantization: INT4 packs {PACK} inputs an int32, and the layer's {k} inputs{share} "
                             f"are not a multiple of {PACK}")
        if group_size_error(g, k):
            raise ValueError(f"{field}: the INT4 kernels' group size {group_size_error(g, k)} (the layer's inputs)")
        if k % g and share and fmt != "int4":     # a rank would hold part of a checkpoint's group
            raise ValueError(f"{field} does not divide the layer's {k} inputs{share}")
        packs_n = fmt in ("awq", "gptq") or (fmt == "compressed-tensors" and not config.symmetric)
        bad = [size for _, size in layer.shards.values() if packs_n and size % PACK]
        if bad:
            share = " (a tensor-parallel rank's share)" if layer.parallel == "column" else ""
            raise ValueError(f"quantization_config: a layer with {bad[0]} outputs{share} cannot be read: the format "
                             f"packs {PACK} outputs an int32")
        names = dict(formats.TABLE_NAMES[fmt])
        if fmt == "compressed-tensors" and config.symmetric:
            del names["zeros"]
        if not config.has_g_idx:
            names.pop("g_idx", None)
        shards = len(layer.shards)
        groups = groups_of(k, g)
        tables = {"qweight": torch.empty(k // PACK, n, dtype=torch.int32), "scales": torch.empty(groups, n),
                  "zeros": torch.full((groups, n), 8.0), "g_idx": torch.empty(shards, k, dtype=torch.int32),
                  "shape": torch.empty(shards, 2, dtype=torch.int64)}
        shard_ids = list(layer.shards) if shards > 1 else None
        for role in ("qweight", "scales", "zeros", "g_idx", "shape"):
            if role in names:
                param = nn.Parameter(tables[role], requires_grad=False)
                layer.register_parameter(names[role], set_weight_loader(param, self.loader_of(layer, role), shard_ids))
                self.names[role] = names[role]
            elif role in ("scales", "zeros"):
                layer.register_buffer(role, tables[role])
                self.names[role] = role
        layer.register_buffer("perm", None)       # act-order: the input permutation (finish_loading)

    def loader_of(self, layer, role: str):
        """The loader of one of the layer's tables, holding the layer weakly: the layer holds the
        parameter, so a parameter holding its layer would keep the weights on the device, in a cycle,
        until a collection ran (ridge/layers/weights.py's LayerLoader, for a method of this object)."""
        layer_ref = weakref.ref(layer)
        return lambda param, loaded, shard_id=None: self.load(layer_ref(), role, param, loaded, shard_id)

    def table(self, layer, role: str) -> torch.Tensor:
        return getattr(layer, self.names[role])

    @torch.no_grad()
    def load(self, layer, role: str, param, loaded: torch.Tensor, shard_id=None) -> None:
        """Convert one checkpoint tensor (this rank's part of it) into the columns of its shard (see the
        module docstring)."""
        off, n = layer.shard_slot(param, shard_id)
        k, g, fmt = layer.in_features, self.group_size, self.config.format
        loaded = self.rank_part(layer, role, loaded, shard_id)
        shape, dtypes, what = formats.TABLE_SPECS[(fmt, role)]
        expected = shape(k, n, groups_of(k, g))
        if loaded.dtype not in dtypes:
            raise ValueError(f"has dtype {loaded.dtype}, expected {' or '.join(map(str, dtypes))} ({what})")
        if tuple(loaded.shape) != expected:
            short = f"; K = {k}: the last of {groups_of(k, g)} groups holds {k % g} inputs" if k % g else ""
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {expected} ({what}, group size {g}{short})")
        t, cols = loaded.to(param.device), slice(off, off + n)
        index = list(layer.shards).index(shard_id) if shard_id is not None else 0
        if role == "g_idx":
            param.data[index] = t
        elif role == "shape":
            if t.tolist() != [n, k]:
                raise ValueError(f"says the weight is {t.tolist()}, expected {[n, k]} ({what})")
            param.data[index] = t
        elif role == "scales":
            param.data[:, cols] = t.t() if fmt == "compressed-tensors" else t
        elif role == "zeros":
            z = {"awq": formats.awq_codes, "compressed-tensors": lambda x: formats.ct_zeros(x).t(),
                 "gptq": partial(formats.gptq_zeros, checkpoint_format=self.config.checkpoint_format)}[fmt](t)
            param.data[:, cols] = z.to(param.dtype)
        elif fmt == "gptq":
            param.data[:, cols] = t
        elif fmt == "int4":
            scales, zeros = self.table(layer, "scales"), self.table(layer, "zeros")
            q, s, z = formats.quantize_rtn(t, g, scale_dtype=scales.dtype)
            param.data[:, cols], scales[:, cols], zeros[:, cols] = pack_int4(q.t()), s.t(), z.t().to(zeros.dtype)
        else:
            q = formats.awq_codes(t) if fmt == "awq" else formats.ct_codes(t).t()     # [K, n]
            param.data[:, cols] = pack_int4(q)

    def rank_part(self, layer, role: str, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        """A tensor-parallel rank's part of a checkpoint tensor: packed words and groups are cut
        whole (an error where a rank's share would split one); a row-parallel rank's g_idx counts
        its own groups from 0, and weight_shape says its own shape."""
        if layer.parallel is None:
            return loaded
        split = formats.TABLE_SPLITS[(self.config.format, role)]
        out_dim, out_per, in_dim, in_per = (self.group_size if p == "g" else p for p in split)
        part = layer.rank_share(loaded, shard_id, out_dim, out_per, in_dim, in_per)
        if role == "g_idx" and layer.parallel == "row":
            part = part - layer.in_slice[0] // self.group_size
        elif role == "shape":
            full = [layer.full_sizes[shard_id or ""], layer.full_in]
            if loaded.tolist() != full:
                raise ValueError(f"says the weight is {loaded.tolist()}, expected {full}")
            part = torch.tensor([layer.out_features if shard_id is None else layer.shards[shard_id][1],
                                 layer.in_features], dtype=loaded.dtype)
        return part

    @torch.no_grad()
    def finish_loading(self, layer) -> None:
        """The act-order permutation (below), then the path each batch bucket takes (int4_dispatch)."""
        self.sort_act_order(layer)
        self.choose_paths(layer)

    def choose_paths(self, layer) -> None:
        qweight = self.table(layer, "qweight")
        if qweight.is_cuda:
            self.set_paths(layer, dispatch_table(qweight, self.table(layer, "scales"), self.table(layer, "zeros"),
                                                 self.group_size))

    def set_paths(self, layer, paths: dict[int, str]) -> None:
        """Take `paths`; where one is "dequant", the shared 16-bit weight holds this layer's."""
        self.paths = paths
        self.workspace = None
        if "dequant" in paths.values():
            scales, weights = self.table(layer, "scales"), self.table(layer, "qweight").numel() * PACK
            self.workspace = DequantWorkspace.shared(scales.device, scales.dtype, weights)

    def sort_act_order(self, layer) -> None:
        """Act-order (GPTQ desc_act, compressed-tensors actorder group): sort the input rows by group so
        each group is G consecutive rows again (ridge's layout), and keep the permutation for x."""
        if "g_idx" not in self.names:
            return
        rows, g = self.table(layer, "g_idx"), self.group_size
        shards = list(layer.shards)
        for i in range(1, rows.shape[0]):
            if not torch.equal(rows[i], rows[0]):
                raise ValueError(f"g_idx of shard {shards[i]!r} differs from shard {shards[0]!r}'s: the merged "
                                 f"projection reads one input order (GPTQ gives every shard of one input the same)")
        k = layer.in_features
        groups, expected = rows[0].long(), torch.arange(k, device=rows.device) // g
        if torch.equal(groups, expected):
            return
        perm = torch.argsort(groups, stable=True)
        if not torch.equal(groups[perm], expected):
            raise ValueError(f"g_idx: every group must hold exactly {g} input rows (group size), and this one "
                             f"does not (values {int(groups.min())}..{int(groups.max())})")
        qweight = self.table(layer, "qweight")
        qweight.copy_(pack_int4(unpack_int4(qweight)[perm]))
        layer.perm = perm

    @torch.no_grad()
    def initialize_dummy(self, layer, generator: torch.Generator, std: float | None = None) -> None:
        """Random tables that start an engine without a checkpoint: q uniform in [0, 15], zero point 8,
        positive scales (never zero), groups in order."""
        qweight, scales, zeros = (self.table(layer, r) for r in ("qweight", "scales", "zeros"))
        dev = qweight.device
        # uniform 32-bit words are eight uniform nibbles: no [K, N] codes to pack (an 8B model in seconds)
        words = torch.randint(0, 2**32, tuple(qweight.shape), generator=generator, device=dev, dtype=torch.int64)
        qweight.copy_((words - 2**31).to(torch.int32))
        scales.uniform_(0.5 * DUMMY_SCALE, 1.5 * DUMMY_SCALE, generator=generator)
        zeros.fill_(8.0)
        if "g_idx" in self.names:
            self.table(layer, "g_idx").copy_(torch.arange(layer.in_features, device=dev) // self.group_size)
        if "shape" in self.names:
            shape = self.table(layer, "shape")
            for i, (_, n) in enumerate(layer.shards.values()):
                shape[i] = torch.tensor([n, layer.in_features])
        layer.perm = None
        self.choose_paths(layer)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias): the INT4 kernels, or for a batch where that measured slower,
        the weight dequantized to x's dtype and cuBLAS (int4_dispatch)."""
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        tables = (self.table(layer, "qweight"), self.table(layer, "scales"), self.table(layer, "zeros"), self.group_size)
        if path_for(self.paths, x2.shape[0]) == "dequant":
            qweight = tables[0]
            y = dequant_matmul(x2, *tables, self.workspace.weight(qweight.shape[0] * PACK, qweight.shape[1]))
        else:
            y = int4_matmul(x2, *tables)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def permute_outputs(self, layer, rows: torch.Tensor) -> None:
        """The tables, quantized as they loaded, are [*, N]: their columns move (codes, scales and zero
        points are per output column of ridge's layout)."""
        for role in ("qweight", "scales", "zeros"):
            t = self.table(layer, role)
            t.data.copy_(t.data[:, rows.to(t.device)])

    def precision(self, act: Precision, rows: int) -> Precision:
        """Half a byte a weight, plus a scale and a zero point (activation dtype) per group of G; where
        the batch takes the dequant path, the 16-bit weight that weight_pass wrote."""
        g = self.group_size
        if path_for(self.paths, rows) == "dequant":
            return Precision(f"int4-g{g}-dequant", act.bytes, compute=act.compute)
        return Precision(f"int4-g{g}", 0.5 + 2 * act.bytes / g, compute=act.compute)

    def weight_pass(self, layer, step: StepShape, rows: int) -> list[OpCost]:
        """The dequant path's kernel before its GEMM (none on the INT4 path): reads the INT4 tables,
        writes the 16-bit weight, (q - z) s: 2 FLOPs a weight. It runs before the GEMM, not under it,
        so at the roofline its memory time adds to the GEMM's compute time."""
        if path_for(self.paths, rows) != "dequant":
            return []
        weights, a = layer.in_features * layer.out_features, step.act.bytes
        tables = weights * (0.5 + 2 * a / self.group_size)
        return [OpCost("int4_dequant", "elementwise", 2 * weights, tables + weights * a, tables,
                       compute=step.act.compute)]
