"""Build a model from an HF checkpoint directory: streamed safetensors, or dummy weights.

Parameters are allocated once, uninitialised, on the target device and dtype. With load_format
"auto" / "safetensors" each checkpoint tensor is then read (memory-mapped, one shard at a time) and
handed by name to its parameter's own weight_loader (ridge/layers/weights.py), which copies it into
place: nothing is copied twice, no full state dict is built. With "dummy" (vLLM's name) every
parameter is filled in place from a seeded generator, so a model of any size (benchmark shapes,
8B-70B) starts in the time it takes to write its weights once, with no checkpoint on disk:
normal(0, 0.02) as transformers initialises matrices and embeddings, norm weights 1 + normal(0,
0.02). Never zeros: a zero weight could let a kernel skip work, or hide a wrong read, that real ones would not.
A module that knows its own tables (an INT4 Linear: integer codes, scales) fills them itself
(`initialize_dummy`), so an 8B-shaped INT4 engine starts without a checkpoint too.

The quantization method (`quantization`) is made before the model is built, by
ridge/layers/quant/registry.py from the setting and config.json's quantization_config, and handed
to the model; its layers then carry the checkpoint format's tensors. A checkpoint in a stored
quantized format has a reader (the registry's too) that hands each weight on as a StoredWeight: a
parameter that keeps the format (`takes_stored`) takes it whole, every other one its
dequantization to the model's dtype. The loader knows no method by name. Once every tensor is in,
each module with a `finish_loading()` hook runs it (INT4 act-order: the input permutation needs all
of a layer's tensors).
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ridge.config import ModelConfig
from ridge.layers.attention import AttentionBackend
from ridge.layers.moe import FusedMoE
from ridge.layers.norm import RMSNorm
from ridge.layers.quant.base import CheckpointReader, StoredWeight
from ridge.layers.quant.registry import quantization_for
from ridge.models.registry import model_class
from ridge.parallel import SINGLE, TensorParallel

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_STD = 0.02
# tensors some checkpoints carry that ridge recomputes or does not need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"model: shard(s) named in the index are missing: {', '.join(map(os.path.basename, missing))}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path!r}")
    return files


def load_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               backend: AttentionBackend, max_position: int, show_progress: bool = True,
               load_format: str = "auto", seed: int = 0, quantization: str | None = None,
               tp: TensorParallel = SINGLE, max_step_tokens: int | None = None) -> torch.nn.Module:
    """The model of `path`, on `device`; with tensor parallelism (`tp`) this rank's share of it: each
    parameter's weight_loader keeps its rank's part of every tensor streamed to it. max_step_tokens
    (the engine's step budget) bounds the batches the expert kernels' plan is measured for."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: unknown format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    quant, reader = quantization_for(quantization, cfg.quantization_config, dummy=load_format == "dummy",
                                     moe_architecture=cfg.architecture if cfg.moe is not None else None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # the rotary tables stay float32: they ask for it
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, backend, max_position, tp, quant)
    finally:
        torch.set_default_dtype(default)
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.max_step_tokens = max_step_tokens
    if load_format == "dummy":
        if quant is not None:
            # float weights still shapes here (a method that makes them layer by layer) say what the model
            # would hold in float
            quant.fit_to_device(sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta),
                                torch.device(device))
        initialize_dummy_weights(model, seed)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"load_model: dummy initialization left {left[0]} (and {len(left) - 1} more) unmade")
    else:
        load_weights(model, path, cfg, show_progress, reader, quant is not None and quant.drops_zero_biases)
    return model.eval()


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in place on its device from one generator seeded with `seed`, in
    parameter order: the same seed gives the same model (see the module docstring). A module with
    `initialize_dummy(generator, std)` fills its own parameters, at its first one's turn."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    owners = {id(p): m for m in model.modules() if callable(getattr(m, "initialize_dummy", None))
              for p in m.parameters(recurse=False)}
    # a parameter on the meta device is only a shape until its owner makes it, on the model's device
    # (a float weight its method makes at its layer's turn: ridge/layers/quant/fp8/linear.py)
    home = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    device = lambda p: home if p.is_meta else p.device      # noqa: E731
    generators = {device(p): torch.Generator(device=device(p)).manual_seed(seed) for p in model.parameters()}
    filled = set()
    for p in list(model.parameters()):
        owner = owners.get(id(p))
        if owner is None:
            p.normal_(1.0 if id(p) in norms else 0.0, DUMMY_STD, generator=generators[device(p)])
        elif id(owner) not in filled:
            filled.add(id(owner))
            owner.initialize_dummy(generators[device(p)], DUMMY_STD)


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: str, cfg: ModelConfig, show_progress: bool = True,
                 reader: CheckpointReader | None = None, drop_zero_biases: bool = False) -> None:
    """Stream the checkpoint's tensors, each to its parameter's weight_loader (with its shard id
    when it is one part of a merged parameter); every expected tensor must arrive exactly once.
    reader: a stored quantized format's (ridge/layers/quant/registry.py), whose StoredWeights are
    dequantized unless their parameter keeps the format (`takes_stored`). drop_zero_biases: a
    quantized checkpoint's all-zero biases of layers that have none are skipped."""
    files = checkpoint_files(path)
    if callable(getattr(model, "expect_checkpoint", None)):
        # a model whose parameters depend on what the checkpoint holds (an EAGLE-3 head's own
        # embedding or fc bias) is told the tensor names first
        names = set()
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                names.update(f.keys())
        model.expect_checkpoint(names)
    params = dict(model.named_parameters())
    expected = {(n, s) for n, p in params.items() for s in (getattr(p, "shard_ids", None) or (None,))}
    loaded = set()
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = None
                    if reader is not None:
                        try:
                            got = reader.feed(name, f.get_tensor(name))
                        except ValueError as e:
                            raise ValueError(f"model: {e}") from None
                        if got is None:
                            continue
                        name, tensor = got
                    if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                        continue
                    pname, shard = model.checkpoint_slot(name)
                    if pname is None:
                        continue            # a tensor the model does not use (an EAGLE-3 head's t2d, MTP layers)
                    if (pname, shard) not in expected:
                        if drop_zero_biases and name.endswith(".bias") and not f.get_tensor(name).any():
                            continue        # AutoGPTQ writes zero biases for layers that have none (vLLM skips them)
                        raise ValueError(f"model: checkpoint tensor {name!r} has no place in {cfg.architecture} "
                                         f"(config and checkpoint disagree)")
                    value = f.get_tensor(name) if tensor is None else tensor
                    if isinstance(value, StoredWeight) and not params[pname].takes_stored:
                        value = value.dequantize()
                    try:
                        params[pname].weight_loader(params[pname], value, shard)
                    except ValueError as e:
                        raise ValueError(f"model: tensor {name!r} {e}") from None
                    loaded.add((pname, shard))
                    bar.update(1)
    if reader is not None:
        try:
            reader.finish()
        except ValueError as e:
            raise ValueError(f"model: {e}") from None
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [model.checkpoint_name(p, s) for p, s in missing]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(f"model: checkpoint {path!r} is missing tensors: {shown}")
    for name, module in model.named_modules():
        if callable(getattr(module, "finish_loading", None)):
            try:
                module.finish_loading()
            except ValueError as e:
                raise ValueError(f"model: {name}: {e}") from None
