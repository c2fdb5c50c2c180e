"""Write a quantized checkpoint: the source checkpoint with each decoder Linear's weight replaced.

INT4 (rtn, awq) is written as compressed-tensors `pack-quantized` (llm-compressor's output; vLLM, SGLang and
transformers load it): per Linear `weight_packed`, `weight_scale`, `weight_zero_point` and
`weight_shape`, and a `quantization_config` in config.json (INT4, group strategy, asymmetric,
lm_head ignored). Why this format rather than AutoAWQ's GEMM layout: see ridge/layers/quant/int4/formats.py;
in short it states its scheme in one schema, keeps the weight's [N, K] orientation, and carries RTN
and AWQ results alike (AWQ's output is an ordinary asymmetric group-quantized weight once its scales
are folded). Packing, the config entry and the round-to-nearest grid are the formats module's, the
same code ridge's loader reads them back with. FP8 (fp8) is written in the HF fp8 block format
(`weight` e4m3 and `weight_scale_inv` per 128 x 128 block: DeepSeek-V3's and Qwen3-*-FP8's,
which transformers, vLLM and ridge read), by ridge/layers/quant/fp8/formats.py's quantizer.

Tensors the plan does not touch are copied bit for bit from the source; tensors it changed (the
norm weights AWQ folded into, biases) are written in the source tensor's dtype. Every other file
of the source directory (tokenizer, generation config, heldout_files.txt, ...) is copied.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ridge.layers.quant.registry import checkpoint_format

INT4 = checkpoint_format("int4")         # the INT4 checkpoint format: round to nearest, compressed-tensors packing
from ridge.models.loader import checkpoint_files
from ridge.quantize.awq import clip_weight

FORMAT = "compressed-tensors pack-quantized"

_NOT_COPIED = ("model.safetensors.index.json", "config.json")       # written anew


def check_out_dir(src: str, out: str) -> None:
    if not out:
        raise ValueError("out: an output directory is required")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out: {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.path.samefile(src, out):
        raise ValueError(f"out: {out!r} is the model's own directory; write the quantized checkpoint elsewhere")
    if os.path.isdir(out) and any(f.endswith(".safetensors") for f in os.listdir(out)):
        raise ValueError(f"out: {out!r} already holds a checkpoint; choose a new or empty directory")


@contextlib.contextmanager
def staged(out: str):
    """A directory beside `out` that the checkpoint is written into; once all of it is written its
    files move into out (made if need be), the weights last, so that a run that dies part way never
    leaves a directory that looks like a checkpoint (ridge and transformers take one holding a
    .safetensors file for one); on a failure it is removed."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.", suffix=".partial", dir=parent)
    try:
        yield tmp
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(tmp), key=lambda n: n.endswith(".safetensors")):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_names(model, ridge_name: str) -> dict[str, str]:
    """A ridge Linear (e.g. model.layers.0.self_attn.qkv_proj) -> {shard id: checkpoint prefix}."""
    inverse = {v: k for k, v in model.checkpoint_name_map.items()}
    parent, merged = ridge_name.rsplit(".", 1)
    lin = model.get_submodule(ridge_name)
    if list(lin.shards) == [""]:
        return {"": ridge_name}
    return {shard: f"{parent}.{inverse[(merged, shard)]}" for shard in lin.shards}


def _leaf_name(model, ridge_param: str) -> dict[str, tuple[str, slice | None]]:
    """A ridge parameter -> {checkpoint tensor name: rows of the ridge parameter (None: all)}."""
    module, leaf = ridge_param.rsplit(".", 1)
    sub = model.get_submodule(module)
    if not getattr(sub, "shards", None) or list(sub.shards) == [""]:
        return {ridge_param: None}
    return {f"{ckpt}.{leaf}": slice(sub.shards[s][0], sum(sub.shards[s]))
            for s, ckpt in checkpoint_names(model, module).items()}


@torch.no_grad()
def quantized_tensors(model, plan, group_size: int, scale_dtype: torch.dtype) -> dict[str, dict]:
    """Checkpoint Linear prefix -> its packed tensors ({suffix: tensor}), from the plan's weights
    (q, scales and zeros are per output row, so a merged Linear splits into its shards by rows)."""
    out = {}
    for name, lp in plan.linears.items():
        q, scales, zeros = INT4.quantize_rtn(clip_weight(lp.weight, group_size, lp.clip), group_size, scale_dtype)
        lin = model.get_submodule(name)
        for shard, ckpt in checkpoint_names(model, name).items():
            first, n = lin.shards[shard]
            rows = slice(first, first + n)
            out[ckpt] = INT4.pack_compressed_tensors(q[rows].cpu(), scales[rows].cpu(), zeros[rows].cpu(), group_size)
    return out


@torch.no_grad()
def fp8_tensors(model, config) -> dict[str, dict]:
    """Checkpoint Linear prefix -> {weight: float8_e4m3fn, weight_scale_inv}: every decoder Linear
    in the HF fp8 block format (ridge/layers/quant/fp8/formats.py), each checkpoint Linear (a shard of a
    merged one) blocked on its own, as the format's readers expect."""
    from ridge.quantize.calib import decoder_linears

    out = {}
    for name, lin in decoder_linears(model).items():
        for shard, ckpt in checkpoint_names(model, name).items():
            first, n = lin.shards[shard]
            q, scale_inv = checkpoint_format("fp8").quantize_fp8_block(lin.weight[first:first + n].float().cpu(), config)
            out[ckpt] = {"weight": q, "weight_scale_inv": scale_inv}
    return out


def quantization_config(group_size: int) -> dict:
    """Asymmetric (zero points), group strategy; the LM head stays in the model's dtype."""
    return INT4.compressed_tensors_config(group_size, symmetric=False, ignore=["lm_head"])


def write_checkpoint(model, src: str, out: str, plan, quantized: dict[str, dict], quant_config: dict) -> None:
    """src's checkpoint with the quantized Linears and the plan's changed tensors (plan None: none),
    into out."""
    replaced = {}
    for pname, t in (plan.tensors if plan is not None else {}).items():
        for ckpt, rows in _leaf_name(model, pname).items():
            replaced[ckpt] = (t if rows is None else t[rows]).cpu()
    tensors, seen = {}, set()
    for file in checkpoint_files(src):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                prefix = name.removesuffix(".weight")
                if name.endswith(".weight") and prefix in quantized:
                    tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in quantized[prefix].items()})
                    seen.add(prefix)
                elif name in replaced:
                    tensors[name] = replaced[name].to(f.get_tensor(name).dtype)
                    seen.add(name)
                else:
                    tensors[name] = f.get_tensor(name)
    missing = (set(quantized) | set(replaced)) - seen
    if missing:
        raise ValueError(f"model: the checkpoint has no tensor for {', '.join(sorted(missing)[:4])}")
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in _NOT_COPIED:
            shutil.copy2(path, os.path.join(out, entry))
