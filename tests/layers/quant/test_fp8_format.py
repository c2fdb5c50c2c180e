"""The block-scaled FP8 weight format (ridge/layers/quant/fp8/formats.py, issue 16): quantization bit for bit
as transformers' FineGrainedFP8 writes it, dequantization as transformers reads it, ragged shapes
within e4m3's rounding bound, ue8m0 scales, and errors that name the field or the tensor."""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridge import LLM
from ridge.cli import main
from ridge.layers.quant.fp8.formats import (FP8, FP8_MAX, UE8M0, Fp8BlockConfig, as_blocks, check_fp8_tensors,
                                    dequantize_fp8_block, fp8_config_of, quantize_fp8_block)
from ridge.quantize import quantize
from ridge.utils.random_checkpoint import make_random_checkpoint
from tests.tests_support import prompt_of
from tests.layers.quant.test_int4_formats import edit_config, first_step_logits, plain_checkpoint

fp8_hf = pytest.importorskip("transformers.integrations.finegrained_fp8")


def weight(n, k, seed=0):
    """Rows of very different magnitudes (so blocks get different scales), the first block all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w[:128, :128] = 0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_quantize_matches_transformers_bit_for_bit(ue8m0):
    w = weight(256, 384)
    quantizer = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(128, 128),
                                                                    scale_fmt="ue8m0" if ue8m0 else "float"))
    ref = fp8_hf.Fp8Quantize(quantizer).convert({"layer.weight": w})
    q, s = quantize_fp8_block(w, Fp8BlockConfig((128, 128), ue8m0))
    assert q.dtype == FP8 and torch.equal(q.view(torch.uint8), ref["layer.weight"].view(torch.uint8))
    assert torch.equal(s, ref["layer.weight_scale_inv"].float())
    assert s[0, 0] == 1.0                                  # the all-zero block


@pytest.mark.parametrize("n,k", [(256, 384), (200, 328), (5, 130)])
def test_ragged_blocks_round_trip_within_e4m3_rounding(n, k):
    w = weight(n, k, seed=n).float()
    for cfg in (Fp8BlockConfig(), Fp8BlockConfig(ue8m0=True), Fp8BlockConfig((64, 32))):
        q, s = quantize_fp8_block(w, cfg)
        assert tuple(s.shape) == cfg.scale_shape(n, k) and q.shape == (n, k)
        deq = dequantize_fp8_block(q, s, cfg.block)
        per = s.repeat_interleave(cfg.block[0], 0)[:n].repeat_interleave(cfg.block[1], 1)[:, :k]
        # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative), subnormals spaced 2^-9 x the scale
        assert ((deq - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * per).all(), cfg
        assert (q.float().abs().amax() <= FP8_MAX) and (q.float().abs().amax() > FP8_MAX / 2 or cfg.ue8m0)
        if cfg.ue8m0:
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def test_dequantize_matches_transformers():
    q, s = quantize_fp8_block(weight(256, 384, seed=3))
    ref = fp8_hf._dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_block(q, s, (128, 128)), ref)


def test_config_round_trip_and_named_errors():
    for cfg in (Fp8BlockConfig(), Fp8BlockConfig((64, 128), True)):
        assert Fp8BlockConfig.from_hf(cfg.to_hf()) == cfg
    deepseek = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert Fp8BlockConfig.from_hf(deepseek) == Fp8BlockConfig()
    for change, field in (({"quant_method": "awq"}, "quant_method"), ({"fmt": "e5m2"}, "fmt"),
                          ({"activation_scheme": "static"}, "activation_scheme"),
                          ({"weight_block_size": None}, "weight_block_size"),
                          ({"weight_block_size": [128, 0]}, "weight_block_size"),
                          ({"weight_block_size": [128]}, "weight_block_size"), ({"scale_fmt": "e4m3"}, "scale_fmt")):
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            Fp8BlockConfig.from_hf({**deepseek, **change})


def test_checkpoint_tensors_are_checked_by_name():
    cfg = Fp8BlockConfig()
    q, s = quantize_fp8_block(weight(200, 328))
    check_fp8_tensors("model.layers.0.mlp.down_proj", q, s, 200, 328, cfg)
    bad = [(q.float(), s, "down_proj.weight: expected float8_e4m3fn"),
           (q[:, :256], s, r"down_proj.weight: expected float8_e4m3fn \[200, 328\]"),
           (q, s[:, :2], r"weight_scale_inv: expected float32 \[2, 3\]"),
           (q, s.to(torch.float64), "weight_scale_inv: expected float32"),
           (q, torch.where(s > s.min(), s, torch.zeros_like(s)), "finite and positive"),
           (q, torch.full_like(s, float("nan")), "finite and positive")]
    for wt, sc, message in bad:
        with pytest.raises(ValueError, match=message):
            check_fp8_tensors("model.layers.0.mlp.down_proj", wt, sc, 200, 328, cfg)
    with pytest.raises(ValueError, match="ue8m0 needs powers of two"):
        check_fp8_tensors("x", q, s * 1.5, 200, 328, Fp8BlockConfig(ue8m0=True))
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_fp8_block(torch.zeros(4, dtype=torch.float32))


# ------------------------------------------------------------------ FP8 checkpoints, loaded dequantized
def fp8_checkpoint(src: str, dst: str, block=(128, 128), ue8m0=False, edit=None) -> dict:
    """src's projections written as an HF fp8 block checkpoint (lm_head, embeddings and norms stay as
    they are, as DeepSeek-V3's and Qwen3-FP8's writers leave them); returns the dequantized weights."""
    shutil.copytree(src, dst)
    cfg = Fp8BlockConfig(block, ue8m0)
    out, ref = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith("proj.weight"):
            q, s = quantize_fp8_block(w, cfg)
            # ue8m0 scales stored as float8_e8m0fnu, as transformers and DeepSeek-V3.1 write them
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s.to(UE8M0) if ue8m0 else s
            ref[name] = dequantize_fp8_block(q, s, block)
        else:
            out[name] = ref[name] = w
    if edit:
        edit(out)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    edit_config(dst, quantization_config=cfg.to_hf())
    return ref


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Whole 128 x 128 blocks, and ragged ones (intermediate 328: gate/up's N and down's K), which
    DeepSeek-V3's checkpoints have and transformers' dequantizer cannot read."""
    root = tmp_path_factory.mktemp("fp8")
    return {"whole": make_random_checkpoint(str(root / "whole"), preset="tiny-g128"),
            "ragged": make_random_checkpoint(str(root / "ragged"), preset="tiny-g128", intermediate_size=328)}


def logits_of(path, prompts):
    return first_step_logits(LLM(path, device="cpu", show_progress=False, max_model_len=64, kv_cache_memory=4 << 20),
                             prompts)


@pytest.mark.parametrize("blocks,ue8m0", [("whole", False), ("whole", True), ("ragged", False)])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(sources, tmp_path, blocks, ue8m0):
    ref = fp8_checkpoint(sources[blocks], str(tmp_path / "fp8"), ue8m0=ue8m0)
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 11))]
    fp8 = logits_of(str(tmp_path / "fp8"), prompts)
    plain = logits_of(plain_checkpoint(sources[blocks], str(tmp_path / "plain"), ref), prompts)
    assert torch.equal(fp8, plain)
    if blocks == "ragged":
        return
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")                      # transformers' FP8 loading asks for it
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fp8"), dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0" if ue8m0 else "float"))
    for p, row in zip(prompts, fp8):
        want = hf(torch.tensor([p])).logits[0, -1].float()
        assert (row - want).abs().max() <= 1e-4 * want.abs().max()


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(sources, tmp_path):
    proj = "model.layers.0.mlp.down_proj"
    cases = [(lambda t: t.pop(f"{proj}.weight_scale_inv"), f"'{proj}.weight' has no '{proj}.weight_scale_inv'"),
             (lambda t: t.update({f"{proj}.weight_scale_inv": t[f"{proj}.weight_scale_inv"][:, :1].contiguous()}),
              rf"{proj}.weight_scale_inv: expected float32 \[2, 3\]"),
             (lambda t: t.update({f"{proj}.weight_scale_inv": -t[f"{proj}.weight_scale_inv"]}), "finite and positive"),
             (lambda t: t.update({f"{proj}.weight": t[f"{proj}.weight"].float()}),
              f"'{proj}.weight_scale_inv' has no '{proj}.weight \\(float8_e4m3fn\\)'")]
    for i, (edit, message) in enumerate(cases):
        path = str(tmp_path / f"bad{i}")
        fp8_checkpoint(sources["ragged"], path, edit=edit)
        with pytest.raises(ValueError, match=message):
            LLM(path, device="cpu", show_progress=False, max_model_len=64, kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="quantization: 'int4' does not apply to this FP8 checkpoint"):
        LLM(str(tmp_path / "bad0"), device="cpu", show_progress=False, quantization="int4")


def test_ridge_quantize_fp8_writes_the_format_bit_for_bit(sources, tmp_path, capsys):
    """`ridge quantize --method fp8`: each checkpoint Linear (q, k and v apart, though ridge merges
    them) blocked on its own, the same bits as quantizing the source's tensors directly; the other
    files copied; ridge loads the result."""
    src, out = sources["ragged"], str(tmp_path / "q")
    assert main(["quantize", "--model", src, "--out", out, "--method", "fp8", "--device", "cpu"]) == 0
    assert "HF fp8" in capsys.readouterr().out
    fp8_checkpoint(src, str(tmp_path / "direct"))
    got, want = (load_file(os.path.join(d, "model.safetensors")) for d in (out, str(tmp_path / "direct")))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert Fp8BlockConfig.from_hf(config["quantization_config"]) == Fp8BlockConfig()
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    logits_of(out, [[5, 6, 7]])
    with pytest.raises(ValueError, match="ridge quantize starts from a float checkpoint"):
        quantize(out, str(tmp_path / "again"), method="fp8", device="cpu", show_progress=False)


# ------------------------------------------------------ compressed-tensors float-quantized (llm-compressor's FP8)
def ct_fp8_checkpoint(src: str, dst: str, strategy: str, static_input: bool = False) -> dict:
    """src's projections compressed by compressed-tensors' own FloatQuantizationCompressor (scales
    amax / 448 per tensor, channel or 128 x 128 block); returns what its decompress gives back."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    shutil.copytree(src, dst)
    block = [128, 128] if strategy == "block" else None
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, block_structure=block)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out, ref = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            out[name] = ref[name] = w
            continue
        cfg = Fp8BlockConfig(tuple(block) if block else None, strategy=strategy, scale_name="weight_scale")
        grid = as_blocks(w.float(), cfg.block_for(*w.shape)).abs().amax(dim=(1, 3)) / FP8_MAX
        scale = grid.reshape(1) if strategy == "tensor" else grid
        packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        prefix = name[:-len(".weight")]
        out.update({f"{prefix}.weight": packed["weight"].contiguous(), f"{prefix}.weight_scale": scale})
        if static_input:
            out[f"{prefix}.input_scale"] = torch.tensor([0.02])
        ref[name] = FloatQuantizationCompressor.decompress(packed, scheme)["weight"]
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": block, "observer": "minmax"}
    acts = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
            if static_input else {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True})
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                        "format": "float-quantized"}}, "ignore": ["lm_head"]}
    edit_config(dst, quantization_config=qc)
    return ref


@pytest.mark.parametrize("strategy,static_input", [("tensor", True), ("channel", False), ("block", False)])
def test_compressed_tensors_float_quantized_loads_as_the_library_decompresses_it(sources, tmp_path, strategy,
                                                                                 static_input):
    pytest.importorskip("compressed_tensors")
    ref = ct_fp8_checkpoint(sources["ragged"], str(tmp_path / "ct"), strategy, static_input)
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 11))]
    fp8 = logits_of(str(tmp_path / "ct"), prompts)
    plain = logits_of(plain_checkpoint(sources["ragged"], str(tmp_path / "plain"), ref), prompts)
    assert torch.equal(fp8, plain)


def test_compressed_tensors_fp8_configs_name_the_field():
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]}
    qc = lambda **w: {"quant_method": "compressed-tensors", "format": "float-quantized",    # noqa: E731
                      "config_groups": {"g": {"weights": {**weights, **w}}}}
    assert fp8_config_of(qc()) == Fp8BlockConfig((128, 128), strategy="block", scale_name="weight_scale")
    for change, message in (({"strategy": "group"}, r"config_groups\.g\.weights\.strategy: 'group'"),
                            ({"num_bits": 4}, r"config_groups\.g\.weights: expected num_bits 8"),
                            ({"symmetric": False}, "asymmetric"), ({"block_structure": None}, "block_structure")):
        with pytest.raises(ValueError, match=message):
            fp8_config_of(qc(**change))
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        fp8_config_of({**qc(), "kv_cache_scheme": {"num_bits": 8}})
    assert fp8_config_of({"quant_method": "awq"}) is None and fp8_config_of(None) is None


def test_weight_and_scale_in_different_shards(sources, tmp_path):
    """A weight's scales may come before it and from another shard (the reader holds whichever
    arrives first)."""
    path = str(tmp_path / "sharded")
    fp8_checkpoint(sources["ragged"], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    save_file(scales, os.path.join(path, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(rest, os.path.join(path, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{n: "model-00001-of-00002.safetensors" for n in scales},
                                            **{n: "model-00002-of-00002.safetensors" for n in rest}}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    fp8_checkpoint(sources["ragged"], str(tmp_path / "whole"))
    assert torch.equal(logits_of(path, [[5, 6, 7]]), logits_of(str(tmp_path / "whole"), [[5, 6, 7]]))


def test_quantization_fp8_on_an_fp8_checkpoint_keeps_its_e4m3_weights(sources, tmp_path):
    """An HF fp8 checkpoint with 128 x 128 blocks under --quantization fp8: loaded dequantized, then
    quantized again, it runs on exactly the checkpoint's e4m3 values (each block's maximum is 448 x
    its scale, so quantizing again gives the same bits) and its scales to fp32 rounding."""
    path = str(tmp_path / "fp8")
    fp8_checkpoint(sources["whole"], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=64, kv_cache_memory=4 << 20, quantization="fp8")
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(down.weight_fp8.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
    # the scales come back to within fp32 rounding (448 / (448 x s) then its inverse)
    torch.testing.assert_close(down.weight_scale_inv, tensors[f"{name}.weight_scale_inv"], rtol=1e-6, atol=0)
