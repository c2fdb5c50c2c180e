"""INT4 weight-only linear layers (W4A16): which format a checkpoint is in, and the layer's tables.

`select_quantization` is the choice behind the `quantization` setting (vLLM's --quantization):
None reads config.json's quantization_config (none: a float model); "awq", "gptq" and
"compressed-tensors" name the format the checkpoint must be in; "int4" quantizes a float
checkpoint while it loads (round to nearest, asymmetric min-max, group 128). A configuration ridge
cannot run (bits, group size, a scheme with activation quantization, an unknown method) is a
ValueError naming the config.json field, raised before any weight is read.

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
path (ridge/layers/quant/int4_dispatch.py; a prefill's large batches); its cost is then the
dequant pass (weight_pass) and a GEMM reading the 16-bit weight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ridge.kernels.int4_matmul import PACK, group_size_error, groups_of, int4_matmul, pack_int4, unpack_int4
from ridge.layers.cost import OpCost, Precision, StepShape
from ridge.layers.quant import formats
from ridge.layers.quant.fp8_linear import Fp8Config
from ridge.layers.quant.int4_dispatch import DequantWorkspace, dequant_matmul, dispatch_table, path_for
from ridge.layers.weights import set_weight_loader

FORMATS = ("awq", "gptq", "compressed-tensors")
QUANTIZATIONS = FORMATS + ("int4", "fp8")       # the `quantization` setting's values (ridge/config.py)
AT_LOAD_GROUP = 128
DUMMY_SCALE = 0.02 / 8                    # (q - 8) * scale has about the std of a bf16 dummy weight
# module names a "not converted" entry may match: what ridge keeps unquantized anyway; and (HF Llama
# names, one layer's) the projections it may not match
_UNQUANTIZED = ("lm_head", "model.embed_tokens")
_PROJECTIONS = tuple(f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


@dataclass(frozen=True)
class Int4Config:
    """One INT4 scheme for every projection. group_size -1: one group spans all K inputs."""
    format: str                       # "awq", "gptq", "compressed-tensors", or "int4" (quantized at load)
    group_size: int
    symmetric: bool = False           # z = 8 and no zero-point tensor (compressed-tensors symmetric)
    desc_act: bool = False            # GPTQ act-order: a group's rows are scattered (g_idx)
    has_g_idx: bool = False           # the checkpoint carries a g_idx tensor per layer
    checkpoint_format: str = "gptq"   # GPTQ: "gptq" (v1: z - 1 stored) or "gptq_v2"

    def group_for(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def linear_method(self, layer: nn.Module) -> "Int4Linear":
        """The INT4 path of `layer` (a Linear), its tables registered on it."""
        return Int4Linear(self, layer)

    @classmethod
    def from_hf(cls, qc: dict) -> "Int4Config":
        """From config.json's quantization_config (AutoAWQ, GPTQ, compressed-tensors)."""
        if not isinstance(qc, dict):
            raise ValueError(f"quantization_config: must be a mapping, got {type(qc).__name__}")
        method = str(qc.get("quant_method", "")).lower()
        if method == "awq":
            _bits(qc.get("bits", qc.get("w_bit")), "quantization_config.bits")
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"quantization_config.version: {version!r} is not supported "
                                 f"(ridge reads AutoAWQ's GEMM layout)")
            if qc.get("zero_point", True) is not True:
                raise ValueError(f"quantization_config.zero_point: {qc.get('zero_point')!r} is not supported "
                                 f"(AutoAWQ GEMM checkpoints carry zero points)")
            _not_converted(qc.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert", True)
            return cls("awq", _group(qc.get("group_size", qc.get("q_group_size")), "quantization_config.group_size"))
        if method == "gptq":
            _bits(qc.get("bits"), "quantization_config.bits")
            fmt = qc.get("checkpoint_format") or "gptq"
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported (gptq or gptq_v2)")
            if qc.get("lm_head"):
                raise ValueError("quantization_config.lm_head: true is not supported (ridge keeps the LM head unquantized)")
            if qc.get("dynamic"):
                raise ValueError("quantization_config.dynamic: per-module overrides are not supported")
            return cls("gptq", _group(qc.get("group_size"), "quantization_config.group_size"),
                       symmetric=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)), has_g_idx=True,
                       checkpoint_format=fmt)
        if method == "compressed-tensors":
            return _compressed_tensors(qc)
        raise ValueError(f"quantization_config.quant_method: {qc.get('quant_method')!r} is not supported "
                         f"(ridge loads INT4 {', '.join(FORMATS)})")


def _bits(bits, field: str) -> None:
    if bits != 4:
        raise ValueError(f"{field}: {bits!r} is not supported (INT4 only)")


def _group(g, field: str) -> int:
    if isinstance(g, bool) or not isinstance(g, int) or not (g > 0 or g == -1):
        raise ValueError(f"{field}: {g!r} is not supported (a positive group size, or -1 for one group per output)")
    return g


def _not_converted(entries, field: str, substring: bool) -> None:
    """Modules a config leaves unquantized: ridge quantizes every projection and only those."""
    for e in entries or ():
        if substring:
            hit = [m for m in _PROJECTIONS if e in m]
        else:       # compressed-tensors: the module's full name, or "re:" and a regex matched from its start
            hit = [m for m in _PROJECTIONS if (re.match(e[3:], m) if e.startswith("re:") else e == m)]
        if hit:
            raise ValueError(f"{field}: {e!r} leaves projections unquantized (e.g. {hit[0]}); ridge quantizes every "
                             f"projection and keeps only {' and '.join(_UNQUANTIZED)} in the activation dtype")


def _compressed_tensors(qc: dict) -> Int4Config:
    top = qc.get("format")
    groups = formats.compressed_tensors_groups(qc, "weight-only INT4")
    schemes = set()
    for name, group in groups.items():
        field = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or top
        if fmt != "pack-quantized":
            raise ValueError(f"{field}.format: {fmt!r} is not supported (INT4 pack-quantized only)")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{field}.input_activations: activation quantization is not supported (W4A16 only)")
        w = group.get("weights") or {}
        _bits(w.get("num_bits"), f"{field}.weights.num_bits")
        if w.get("type", "int") != "int":
            raise ValueError(f"{field}.weights.type: {w.get('type')!r} is not supported (int only)")
        strategy = w.get("strategy") or ("channel" if w.get("group_size") in (None, -1) else "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{field}.weights.strategy: {strategy!r} is not supported (group or channel)")
        if w.get("dynamic"):
            raise ValueError(f"{field}.weights.dynamic: {w['dynamic']!r} is not supported (static weights only)")
        size = -1 if strategy == "channel" else _group(w.get("group_size"), f"{field}.weights.group_size")
        actorder = str(w.get("actorder")).lower()
        schemes.add((size, bool(w.get("symmetric", True)), actorder in ("group", "dynamic")))
    if len(schemes) > 1:
        raise ValueError("quantization_config.config_groups: groups with different weight schemes are not supported")
    _not_converted(qc.get("ignore"), "quantization_config.ignore", False)
    size, symmetric, g_idx = schemes.pop()
    return Int4Config("compressed-tensors", size, symmetric=symmetric, has_g_idx=g_idx)


def select_quantization(setting: str | None, hf_config: dict | None) -> Int4Config | Fp8Config | None:
    """The scheme a model loads with, from the `quantization` setting and config.json's quantization_config."""
    if setting == "fp8":
        if hf_config is not None:
            raise ValueError(f"quantization: 'fp8' quantizes a float checkpoint at load, and this checkpoint is "
                             f"quantized (quantization_config.quant_method {hf_config.get('quant_method')!r})")
        return Fp8Config()
    if setting == "int4":
        if hf_config is not None:
            raise ValueError(f"quantization: 'int4' quantizes a float checkpoint at load, and this checkpoint is "
                             f"already quantized (quantization_config.quant_method "
                             f"{hf_config.get('quant_method')!r}); leave quantization unset to load it as it is")
        return Int4Config("int4", AT_LOAD_GROUP)
    if setting is not None and setting not in FORMATS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}; got {setting!r}")
    if hf_config is None:
        if setting is not None:
            raise ValueError(f"quantization: {setting!r} needs a checkpoint whose config.json has a "
                             f"quantization_config, and this one has none (use 'int4' to quantize at load)")
        return None
    cfg = Int4Config.from_hf(hf_config)
    if setting is not None and setting != cfg.format:
        raise ValueError(f"quantization: {setting!r} does not match the checkpoint's "
                         f"quantization_config.quant_method {hf_config.get('quant_method')!r}")
    return cfg


# -- the layer -------------------------------------------------------------------------------------
class Int4Linear:
    """A Linear's INT4 tables and how they load, run and cost (the Linear passes itself in)."""

    def __init__(self, config: Int4Config, layer: nn.Module):
        self.config, fmt = config, config.format
        k, n = layer.in_features, layer.out_features
        if layer.parallel == "row" and (config.group_size == -1 or config.desc_act):
            groups = "act-order (desc_act) groups" if config.desc_act else "one group of all inputs"
            raise ValueError(f"quantization_config: {groups} cannot be split across {layer.tp.size} tensor-parallel "
                             f"ranks (each holds a share of the inputs); load it with tensor_parallel_size 1")
        self.group_size = g = config.group_for(k)
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
        self.names = {}
        for role in ("qweight", "scales", "zeros", "g_idx", "shape"):
            if role in names:
                param = nn.Parameter(tables[role], requires_grad=False)
                layer.register_parameter(names[role], set_weight_loader(param, partial(self.load, layer, role), shard_ids))
                self.names[role] = names[role]
            elif role in ("scales", "zeros"):
                layer.register_buffer(role, tables[role])
                self.names[role] = role
        layer.register_buffer("perm", None)       # act-order: the input permutation (finish_loading)
        self.paths: dict[int, str] | None = None    # batch bucket -> "int4" / "dequant" (int4_dispatch)
        self.workspace: DequantWorkspace | None = None      # the dequant path's 16-bit weight

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
