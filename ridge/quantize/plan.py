"""What quantizing a Llama-family model does to each of its tensors, on ridge's own model.

`plan_model` walks the decoder layers in order (a progress bar per layer) and returns, per
decoder Linear (ridge's merged qkv_proj and gate_up_proj included), the float32 weight to quantize
and its clipping ratios, plus the float tensors AWQ changed by folding (the RMSNorm weights, v
and up rows' biases), all under ridge's parameter names; checkpoint.py maps them back to the
checkpoint's. RTN quantizes each weight as it is; AWQ first searches and folds scales (awq.py).
The model itself is left untouched: the plan is computed on float32 copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ridge.kernels.int4_matmul import PACK
from ridge.quantize.awq import fake_quantize, output_error, search_clip, search_scale


@dataclass
class LinearPlan:
    weight: torch.Tensor                     # float32 [N, K], scales folded in
    clip: torch.Tensor | None = None         # [N, ceil(K / group_size)] range ratios, or None
    report: dict = field(default_factory=dict)


@dataclass
class ModelPlan:
    linears: dict[str, LinearPlan]           # ridge Linear name -> its plan
    tensors: dict[str, torch.Tensor]         # ridge parameter name -> changed float tensor


def check_model(model, group_size: int) -> None:
    """Every decoder Linear's input width must be a multiple of 8 (an int32 packs 8 codes along K);
    say which is not. The group size need not divide it (a short last group, formats.quantize_rtn)."""
    from ridge.quantize.calib import decoder_linears

    for name, lin in decoder_linears(model).items():
        if lin.weight.shape[1] % PACK:
            raise ValueError(f"model: the {lin.weight.shape[1]} input features of {name} are not a multiple of "
                             f"{PACK} (INT4 packs {PACK} an int32)")


def _rows(lin, shard: str) -> slice:
    first, n = lin.shards[shard]
    return slice(first, first + n)


def _relative(err: float, w: torch.Tensor, h: torch.Tensor) -> float:
    """Output error over output energy (sum((W H) * W)): comparable across layers and methods."""
    energy = float(((w @ h) * w).sum())
    return err / energy if energy > 0 else 0.0


@torch.no_grad()
def plan_model(model, method: str, group_size: int, stats=None, scale_dtype: torch.dtype = torch.float32,
               show_progress: bool = True) -> ModelPlan:
    """`stats(i)`: the calibration InputStats of layer i's Linears by name (calib.LayerStats; AWQ only)."""
    check_model(model, group_size)
    cfg, prefix = model.cfg, "model.layers"
    linears, tensors = {}, {}
    layers = model.model.layers
    for i, layer in enumerate(tqdm(layers, desc=method.upper(), unit="layer", disable=not show_progress)):
        attn, mlp, p = layer.self_attn, layer.mlp, f"{prefix}.{i}"
        names = {"qkv": f"{p}.self_attn.qkv_proj", "o": f"{p}.self_attn.o_proj",
                 "gate_up": f"{p}.mlp.gate_up_proj", "down": f"{p}.mlp.down_proj"}
        mods = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        w = {k: m.weight.float().clone() for k, m in mods.items()}
        if method == "rtn":
            for k, m in mods.items():
                linears[names[k]] = LinearPlan(w[k])
            continue
        layer_stats = stats(i)
        h = {k: layer_stats[names[k]].hessian.to(w[k].device) for k in mods}
        mean_abs = {k: layer_stats[names[k]].mean_abs.to(w[k].device) for k in mods}
        found, scales = {}, {}
        tie = (cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        for k in mods:
            found[k] = search_scale(w[k], mean_abs[k], h[k], group_size, scale_dtype, tie if k == "o" else None)
            scales[k] = found[k].scale
        # fold: each input scale into the op before the Linear (module docstring of awq.py)
        norms = {"qkv": (f"{p}.input_layernorm.weight", layer.input_layernorm.weight),
                 "gate_up": (f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)}
        for k, (pname, weight) in norms.items():
            tensors[pname] = weight.float() / scales[k]
        row_folds = {"o": ("qkv", "v", scales["o"].reshape(cfg.num_kv_heads, tie[0], cfg.head_dim)[:, 0].reshape(-1)),
                     "down": ("gate_up", "up", scales["down"])}
        originals = {k: v.clone() for k, v in w.items()}
        for k in mods:
            w[k] *= scales[k]
        for k, (target, shard, s) in row_folds.items():
            rows = _rows(mods[target], shard)
            w[target][rows] /= s[:, None]
            if mods[target].bias is not None:
                bname = f"{names[target]}.bias"
                bias = tensors.setdefault(bname, mods[target].bias.float().clone())
                bias[rows] /= s
        for k in mods:
            clip_rows = None
            if k == "qkv":                       # q and k do not clip (awq.py)
                clip_rows = torch.zeros(w[k].shape[0], dtype=torch.bool, device=w[k].device)
                clip_rows[_rows(mods[k], "v")] = True
            clip = search_clip(w[k], h[k], group_size, scale_dtype, clip_rows, scales[k])
            ref = w[k] / scales[k]                # the folded, unquantized weight seen from x
            final = output_error(fake_quantize(w[k], group_size, clip, scale_dtype) / scales[k], ref, h[k])
            rtn = output_error(fake_quantize(originals[k], group_size, scale_dtype=scale_dtype), originals[k], h[k])
            report = dict(alpha=found[k].alpha, clipped=clip is not None,
                          rtn_rel_error=_relative(rtn, originals[k], h[k]), awq_rel_error=_relative(final, ref, h[k]))
            linears[names[k]] = LinearPlan(w[k], clip, report)
    return ModelPlan(linears, tensors)
