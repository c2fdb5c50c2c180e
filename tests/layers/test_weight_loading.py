"""Per-parameter weight loading (ridge/layers/weights.py, ridge/models/loader.py) and
load_format="dummy".

Each parameter carries `weight_loader(param, loaded, shard_id=None)` and `shard_ids`; a merged
projection's loader narrows to its shard; the model loader only streams safetensors and
dispatches by name, with errors that name the tensor. Dummy weights come from a seeded generator
on the device: the same seed gives the same model, never a zero, nothing but config.json read.
"""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridge.config import ModelConfig
from ridge.layers.attention import TORCH_BACKEND
from ridge.layers.linear import Linear
from ridge.layers.norm import RMSNorm
from ridge.layers.weights import default_weight_loader
from ridge.models.loader import LOAD_FORMATS, load_model
from ridge.utils.random_checkpoint import make_random_checkpoint


def build(path, load_format="auto", seed=0, dtype=torch.float32):
    return load_model(path, ModelConfig.from_dir(path), dtype, torch.device("cpu"), TORCH_BACKEND,
                      max_position=64, show_progress=False, load_format=load_format, seed=seed)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("cfg") / "tiny"), config_only=True)


# -------------------------------------------------------------------------------- the loaders
def test_merged_linear_loader_narrows_to_its_shard():
    layer = Linear(3, {"q": 4, "k": 2, "v": 2}, bias=True)
    assert layer.weight.shard_ids == layer.bias.shard_ids == ("q", "k", "v")
    layer.weight.data.fill_(float("nan"))
    parts = {s: torch.full((n, 3), float(i)) for i, (s, n) in enumerate((("q", 4), ("k", 2), ("v", 2)))}
    for shard, t in parts.items():
        layer.weight.weight_loader(layer.weight, t, shard)
    assert torch.equal(layer.weight.data, torch.cat(list(parts.values())))
    layer.bias.weight_loader(layer.bias, torch.arange(2.0), "k")
    assert torch.equal(layer.bias.data[4:6], torch.arange(2.0))
    with pytest.raises(ValueError, match=r"has shape \(3, 3\), expected \(2, 3\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 3), "k")
    with pytest.raises(ValueError, match="shard"):
        layer.weight.weight_loader(layer.weight, torch.zeros(2, 3), "gate")
    with pytest.raises(ValueError, match="shard"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 3))      # a merged param wants its shard id


def test_unmerged_parameters_load_whole_with_a_shape_check():
    plain = Linear(3, 5)
    assert plain.weight.shard_ids is None and plain.bias is None
    w = torch.randn(5, 3)
    plain.weight.weight_loader(plain.weight, w)
    assert torch.equal(plain.weight.data, w)
    with pytest.raises(ValueError, match="shard"):
        plain.weight.weight_loader(plain.weight, w, "q")
    norm = RMSNorm(4, 1e-6)
    assert norm.weight.weight_loader is default_weight_loader and norm.weight.shard_ids is None
    norm.weight.weight_loader(norm.weight, torch.arange(4.0, dtype=torch.float64))   # converts the dtype
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight.data, torch.arange(4.0))
    with pytest.raises(ValueError, match=r"has shape \(5,\), expected \(4,\)"):
        default_weight_loader(norm.weight, torch.zeros(5))
    with pytest.raises(ValueError, match="shard"):
        default_weight_loader(norm.weight, torch.zeros(4), "q")


# ---------------------------------------------------------------------------------- dispatch
def test_loader_dispatches_each_tensor_to_its_parameter_and_shard(checkpoints):
    path = checkpoints("qwen2")    # q/k/v biases: merged biases too
    model = build(path)
    assert model.checkpoint_slot("model.layers.1.self_attn.k_proj.bias") == ("model.layers.1.self_attn.qkv_proj.bias", "k")
    assert model.checkpoint_slot("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", "up")
    assert model.checkpoint_slot("model.norm.weight") == ("model.norm.weight", None)
    ckpt = load_file(f"{path}/model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}"
        for leaf in ("weight", "bias"):
            qkv = torch.cat([ckpt[f"{pre}.self_attn.{p}_proj.{leaf}"] for p in "qkv"])
            assert torch.equal(getattr(model.model.layers[i].self_attn.qkv_proj, leaf), qkv)
        gate_up = torch.cat([ckpt[f"{pre}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(model.model.layers[i].mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(model.model.layers[i].input_layernorm.weight, ckpt[f"{pre}.input_layernorm.weight"])
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    every = [p for p in model.parameters()]
    assert all(callable(p.weight_loader) for p in every)


def test_loader_errors_name_the_tensor(tmp_path, checkpoints):
    src = checkpoints("llama")

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(src, d)
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    bad_shape = variant("shape", lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(3, 64\), "
                                         r"expected \(128, 64\)"):
        build(bad_shape)
    extra = variant("extra", lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' has no place"):
        build(extra)
    missing = variant("missing", lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.gate_proj\.weight$"):
        build(missing)


def test_unknown_load_format_is_rejected(config_only):
    with pytest.raises(ValueError, match=r"load_format: unknown format 'pt'; expected one of auto, safetensors, dummy"):
        build(config_only, load_format="pt")
    assert LOAD_FORMATS == ("auto", "safetensors", "dummy")


# ------------------------------------------------------------------------------- dummy weights
def test_dummy_weights_are_seeded_small_and_never_zero(config_only):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        build(config_only)                         # a config-only directory has no weights to read
    a, b, c = build(config_only, "dummy", seed=1), build(config_only, "dummy", seed=1), build(config_only, "dummy", seed=2)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert pa.keys() == pb.keys() == pc.keys()
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name
        assert not torch.equal(p, pc[name]), name
        assert p.count_nonzero() == p.numel(), name
        if name.endswith("norm.weight"):
            assert 0.8 < p.min() and p.max() < 1.2 and abs(p.mean() - 1) < 0.01, name
        else:
            assert abs(p.std() - 0.02) < 0.004 and abs(p.mean()) < 0.005, name
    bf16 = build(config_only, "dummy", seed=1, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.count_nonzero() == p.numel() for p in bf16.parameters())


def test_engine_generates_with_dummy_weights(config_only):
    """A config-only tiny checkpoint serves requests with load_format="dummy", same seed same tokens."""
    from ridge import LLM, SamplingParams

    def generate(seed=3):
        llm = LLM(config_only, load_format="dummy", seed=seed, device="cpu", max_model_len=64, show_progress=False)
        out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        return out[0].outputs[0].token_ids

    first = generate()
    assert len(first) == 6 and first == generate()


def test_fp8_dummy_weights_are_made_layer_by_layer(config_only, monkeypatch):
    """--quantization fp8 with dummy weights: no float weight exists for the whole model at once (a 70B
    shape would not fit one GPU in bf16). Each layer's is a meta-device shape until its turn, made
    on the model's device, quantized and dropped; the FP8 values are those of quantizing the plain
    dummy model (same generator stream), and at most one layer's float weight is alive at a time."""
    from ridge.layers.quant.fp8 import linear as fp8_linear
    from ridge.layers.quant.fp8.config import Fp8Config
    from ridge.layers.quant.fp8.formats import quantize_fp8_block

    layer = Linear(256, {"gate": 128, "up": 128}, quant=Fp8Config(dummy=True))
    assert layer.weight.is_meta and layer.weight.shard_ids == ("gate", "up")
    assert Linear(256, 128, quant=Fp8Config()).weight.device.type == "cpu"   # a checkpoint loads into it

    peak = [0]
    made = fp8_linear.Fp8Linear.finish_loading

    def tracking(self, lin):              # float weights in memory as a layer is quantized
        real = [m for m in model_layers if m.quant_method is not None and m.weight is not None and not m.weight.is_meta]
        peak[0] = max(peak[0], len(real))
        made(self, lin)
    monkeypatch.setattr(fp8_linear.Fp8Linear, "finish_loading", tracking)
    model_layers = []
    orig_init = Linear.__init__

    def recording(self, *a, **k):
        orig_init(self, *a, **k)
        model_layers.append(self)
    monkeypatch.setattr(Linear, "__init__", recording)
    path = config_only
    fp8 = load_model(path, ModelConfig.from_dir(path), torch.bfloat16, torch.device("cpu"), TORCH_BACKEND,
                     max_position=64, show_progress=False, load_format="dummy", seed=4, quantization="fp8")
    monkeypatch.undo()
    assert not any(p.is_meta for p in fp8.parameters())
    assert peak[0] == 1                      # one float weight at a time (the CPU reference keeps none)
    plain = load_model(path, ModelConfig.from_dir(path), torch.bfloat16, torch.device("cpu"), TORCH_BACKEND,
                       max_position=64, show_progress=False, load_format="dummy", seed=4)
    quantized = {n: m for n, m in fp8.named_modules() if isinstance(m, Linear) and m.quant_method is not None}
    assert quantized
    floats = dict(plain.named_modules())
    for name, m in quantized.items():
        assert m.weight is None, name
        q, s = quantize_fp8_block(floats[name].weight.data)
        assert torch.equal(m.weight_fp8.view(torch.uint8), q.view(torch.uint8)) and torch.equal(m.weight_scale_inv, s), name
