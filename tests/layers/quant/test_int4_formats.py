"""INT4 checkpoints (issue 15): AutoAWQ GEMM, GPTQ (v1 and v2 zero points, act-order g_idx) and
compressed-tensors pack-quantized, recognised from config.json; `quantization="int4"` on a float
checkpoint; errors that name the tensor or the config field.

Each checkpoint is built from a random transformers checkpoint: its projections quantized by
round-to-nearest and packed per the format's specification (ridge.layers.quant.int4.formats, whose
packers are checked here against the formats' own packing code: AutoAWQ's and AutoGPTQ's loops,
compressed-tensors' pack_to_int32). The oracle is the same model with the dequantized weights as a
plain float checkpoint: transformers cannot run AWQ or GPTQ on a CPU here (their kernels need
autoawq / gptqmodel and a GPU). For compressed-tensors transformers can (it decompresses with the
compressed-tensors library), so its logits are checked against transformers too.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridge import LLM, SamplingParams
from ridge.config import EngineConfig, ModelConfig
from ridge.kernels.int4_matmul import dequantize_int4, unpack_int4
from ridge.layers.attention import TORCH_BACKEND
from ridge.layers.cost import StepShape
from ridge.layers.quant.int4 import formats as F
from ridge.layers.quant.int4.config import Int4Config
from ridge.layers.quant.registry import select_quantization
from ridge.models.loader import load_model
from ridge.utils.random_checkpoint import make_random_checkpoint
from tests.tests_support import prompt_of

# the input each projection reads: projections of one input share GPTQ's act-order permutation
INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp",
            "down_proj": "down"}
# name -> (source arch, format, group size, scale dtype, options); names sharing a reference share its weights
VARIANTS = {
    "awq": ("llama", "awq", 64, torch.float16, {}),
    "gptq-v2": ("llama", "gptq", 64, torch.float16, {"checkpoint_format": "gptq_v2"}),
    "gptq-act-order": ("llama", "gptq", 64, torch.float16, {"desc_act": True}),
    "ct": ("llama", "compressed-tensors", 128, torch.float32, {}),
    "ct-sym-qwen2": ("qwen2", "compressed-tensors", 64, torch.float32, {"symmetric": True}),
}
REFERENCE = {"awq": "rtn-g64-fp16", "gptq-v2": "rtn-g64-fp16", "gptq-act-order": "act-order",
             "ct": "rtn-g128", "ct-sym-qwen2": "sym-qwen2"}


def quantize_checkpoint(src: str, dst: str, fmt: str, group: int, scale_dtype, desc_act=False,
                        checkpoint_format="gptq", symmetric=False) -> dict:
    """Write src's model quantized and packed as `fmt` to dst (config.json with its quantization_config);
    returns the dequantized weights by checkpoint name (the reference)."""
    shutil.copytree(src, dst)
    tensors, out, ref, perms = load_file(os.path.join(src, "model.safetensors")), {}, {}, {}
    gen = torch.Generator().manual_seed(7)
    for name, w in tensors.items():
        proj = name.split(".")[-2]
        if not name.endswith("proj.weight") or proj not in INPUT_OF:
            out[name] = ref[name] = w
            continue
        k, g_idx = w.shape[1], None
        if desc_act:       # GPTQ act-order: rows quantized in a permuted order, g_idx[k] = position // G
            perm = perms.setdefault((name.split(".")[2], INPUT_OF[proj]), torch.randperm(k, generator=gen))
            qp, s, z = F.quantize_rtn(w[:, perm], group, scale_dtype)
            q = torch.empty_like(qp)
            q[:, perm] = qp
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        else:
            q, s, z = F.quantize_rtn(w, group, scale_dtype, symmetric=symmetric)
        ref[name] = F.dequantize(q, s, z, group, g_idx)
        packed = (F.pack_awq(q, s, z, group) if fmt == "awq" else
                  F.pack_gptq(q, s, z, group, g_idx, checkpoint_format) if fmt == "gptq" else
                  F.pack_compressed_tensors(q, s, None if symmetric else z, group))
        out.update({name[:-len("weight")] + leaf: t for leaf, t in packed.items()})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    qc = (F.awq_config(group) if fmt == "awq" else
          F.gptq_config(group, desc_act=desc_act, checkpoint_format=checkpoint_format) if fmt == "gptq" else
          F.compressed_tensors_config(group, symmetric))
    edit_config(dst, quantization_config=qc)
    return ref


def edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(p, "w") as f:
        json.dump(cfg, f)


def plain_checkpoint(src: str, dst: str, weights: dict) -> str:
    """src's config and tokenizer with `weights` (float32) as its safetensors."""
    shutil.copytree(src, dst)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per variant (quantized checkpoint, its reference weights), per reference a plain checkpoint."""
    root = tmp_path_factory.mktemp("int4")
    src = {a: make_random_checkpoint(str(root / f"src-{a}"), arch=a, preset="tiny-g128") for a in ("llama", "qwen2")}
    quantized, plain = {}, {}
    for name, (arch, fmt, group, sdt, opts) in VARIANTS.items():
        ref = quantize_checkpoint(src[arch], str(root / name), fmt, group, sdt, **opts)
        quantized[name] = (str(root / name), ref)
        if REFERENCE[name] not in plain:
            plain[REFERENCE[name]] = plain_checkpoint(src[arch], str(root / REFERENCE[name]), ref)
    return dict(src=src, quantized=quantized, plain=plain)


def build(path, quantization=None, load_format="auto", seed=0):
    return load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), TORCH_BACKEND,
                      max_position=64, show_progress=False, load_format=load_format, seed=seed,
                      quantization=quantization)


def engine(path, **kw):
    return LLM(path, device="cpu", show_progress=False, max_model_len=128, kv_cache_memory=8 << 20, **kw)


def dequantized_layers(model) -> dict:
    """Every INT4 projection's weight [N, K] in the checkpoint's input order (act-order undone)."""
    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        w = dequantize_int4(qm.table(m, "qweight"), qm.table(m, "scales"), qm.table(m, "zeros"), qm.group_size)
        if m.perm is not None:
            w = torch.empty_like(w).index_copy_(0, m.perm, w)
        out[name] = w.t()
    return out


def merged_reference(ref: dict, module: str) -> torch.Tensor:
    parent, leaf = module.rsplit(".", 1)
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf, (leaf,))
    return torch.cat([ref[f"{parent}.{p}.weight"] for p in parts])


# ------------------------------------------------------------------------------------ packing
def test_packers_match_the_formats_own_packing_code():
    torch.manual_seed(0)
    n, k, g = 24, 128, 32
    q, s, z = F.quantize_rtn(torch.randn(n, k), g)
    # AutoAWQ WQLinear_GEMM.from_linear: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    awq = F.pack_awq(q, s, z, g)
    for packed, codes in ((awq["qweight"], q.t()), (awq["qzeros"], z.t())):
        loop = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int32)
        for col in range(loop.shape[1]):
            for i, j in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                loop[:, col] |= codes[:, col * 8 + j].int() << (i * 4)
        assert torch.equal(packed, loop)
        assert torch.equal(F.awq_codes(packed), codes)
    # AutoGPTQ QuantLinear.pack: qweight rows pack 8 consecutive input rows; qzeros store z - 1 (v1)
    gp = F.pack_gptq(q, s, z, g)
    qw = torch.zeros(k // 8, n, dtype=torch.int64)
    qz = torch.zeros(k // g, n // 8, dtype=torch.int64)
    for row in range(k // 8):
        for j in range(8):
            qw[row] |= q.t()[row * 8 + j].long() << (4 * j)
    for col in range(n // 8):
        for j in range(8):
            qz[:, col] |= (z.t()[:, col * 8 + j].long() - 1) << (4 * j)
    int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).int()      # noqa: E731 (uint32 bits as int32)
    assert torch.equal(gp["qweight"], int32(qw)) and torch.equal(gp["qzeros"], int32(qz))
    assert torch.equal(F.gptq_zeros(gp["qzeros"], "gptq"), z.t())
    assert torch.equal(gp["g_idx"], (torch.arange(k) // g).int()) and gp["scales"].dtype == torch.float16
    with pytest.raises(ValueError, match=r"zeros: must be integers in \[1, 15\]"):
        F.pack_gptq(q, s, torch.zeros_like(z), g)            # v1 cannot store a zero point of 0
    # compressed-tensors' own packer (pack_to_int32 of the signed values, zero point packed along N)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    ct = F.pack_compressed_tensors(q, s, z, g)
    assert torch.equal(ct["weight_packed"], helpers.pack_to_int32((q - 8).to(torch.int8), 4))
    assert torch.equal(ct["weight_zero_point"], helpers.pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0))
    assert ct["weight_shape"].tolist() == [n, k] and ct["weight_shape"].dtype == torch.int64
    assert torch.equal(F.ct_codes(ct["weight_packed"]), q) and torch.equal(F.ct_zeros(ct["weight_zero_point"]), z)
    assert "weight_zero_point" not in F.pack_compressed_tensors(q, s, None, g)


def test_rtn_matches_compressed_tensors_min_max():
    qparams = pytest.importorskip("compressed_tensors.quantization.utils")
    from compressed_tensors.quantization import QuantizationArgs
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    for symmetric in (False, True):
        q, s, z = F.quantize_rtn(w, 128, symmetric=symmetric)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=128)
        g = w.reshape(16, 2, 128)
        scale, zp = qparams.calculate_qparams(g.amin(2), g.amax(2), args)
        assert torch.allclose(scale, s) and torch.equal(zp.round().int() + 8, z)
        assert (F.dequantize(q, s, z, 128) - w).abs().max() <= s.max() / 2 * (1 + 1e-6)


# ------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_format_loads_the_reference_weights_exactly(built, name):
    path, ref = built["quantized"][name]
    layers = dequantized_layers(build(path))
    assert len(layers) == 8                                  # 4 projections x 2 layers, all INT4
    for module, w in layers.items():
        assert torch.equal(w, merged_reference(ref, module)), module
    if name == "gptq-act-order":
        model = build(path)
        assert all(m.perm is not None for m in model.modules() if getattr(m, "quant_method", None))


def test_quantization_int4_on_a_float_checkpoint_is_the_rtn_reference(built):
    src, (_, ref) = built["src"]["llama"], built["quantized"]["ct"]      # RTN, group 128, float32 scales
    model = build(src, quantization="int4")
    assert model.model.layers[0].mlp.gate_up_proj.quant_method.config == Int4Config("int4", 128)
    for module, w in dequantized_layers(model).items():
        assert torch.equal(w, merged_reference(ref, module)), module
    assert getattr(model.lm_head, "quant_method", None) is None and model.lm_head.weight.dtype == torch.float32


def first_step_logits(llm, prompts):
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    logits = eng.runner.execute(eng.scheduler.schedule()).logits.clone()
    for rid in list(eng.requests):
        eng.abort(rid)
    return logits


PROMPTS = [prompt_of(n, salt=i) for i, n in enumerate((5, 19))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("name", list(VARIANTS) + ["int4"])
def test_int4_engine_matches_the_dequantized_model(built, name):
    """Same logits up to fp32 summation order, same greedy tokens, as the plain dequantized model."""
    if name == "int4":
        int4, plain = engine(built["src"]["llama"], quantization="int4"), engine(built["plain"]["rtn-g128"])
    else:
        int4, plain = engine(built["quantized"][name][0]), engine(built["plain"][REFERENCE[name]])
    a, b = first_step_logits(int4, PROMPTS), first_step_logits(plain, PROMPTS)
    assert ((a - b).norm(dim=1) / b.norm(dim=1)).max() < 1e-5
    tokens = [o.outputs[0].token_ids for o in int4.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_matches_transformers(built):
    """transformers runs compressed-tensors on a CPU (decompressed by the library): logits to 1e-4."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    path = built["quantized"]["ct"][0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    logits = first_step_logits(engine(path), PROMPTS)
    for row, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        assert ((logits[row] - ref).norm() / ref.norm()).item() < 1e-4


# ------------------------------------------------------------------------------------ the setting
def test_quantization_setting_selects_or_refuses(built):
    awq, plain = built["quantized"]["awq"][0], built["src"]["llama"]
    assert select_quantization(None, None) is None
    assert select_quantization("awq", ModelConfig.from_dir(awq).quantization_config).format == "awq"
    assert select_quantization("int4", None) == Int4Config("int4", 128)
    cases = [(awq, "gptq", r"quantization: 'gptq' does not match the checkpoint's quantization_config.quant_method "
                           r"'awq'"),
             (awq, "int4", r"quantization: 'int4' quantizes a float checkpoint at load"),
             (plain, "compressed-tensors", r"quantization: 'compressed-tensors' needs a checkpoint whose config.json "
                                           r"has a quantization_config")]
    for path, setting, error in cases:
        with pytest.raises(ValueError, match=error):
            engine(path, quantization=setting)
    with pytest.raises(ValueError, match=r"^quantization: must be one of awq, gptq, compressed-tensors, int4, fp8"):
        EngineConfig(quantization="fp16")
    with pytest.raises(ValueError, match=r"quantization: 'fp8' quantizes a float checkpoint at load"):
        engine(awq, quantization="fp8")


@pytest.mark.parametrize("qc, error", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"quantization_config\.bits: 8 is not supported \(INT4 only\)"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quantization_config\.bits: 3 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"quantization_config\.version: 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 0}, r"quantization_config\.group_size: 0 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"quantization_config\.checkpoint_format: 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, r"quantization_config\.lm_head"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method: 'bitsandbytes' is not supported"),
    ({**F.compressed_tensors_config(128, True), "ignore": ["lm_head", "re:.*mlp.down_proj"]},
     r"quantization_config\.ignore: 're:\.\*mlp\.down_proj' leaves projections unquantized"),
])
def test_unsupported_quantization_configs_name_the_field(qc, error):
    with pytest.raises(ValueError, match=error):
        Int4Config.from_hf(qc)


def test_compressed_tensors_formats_bits_and_activation_schemes_are_refused():
    qc = F.compressed_tensors_config(128, False)
    qc["config_groups"]["group_0"]["format"] = "float-quantized"
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.format: 'float-quantized' is not supported"):
        Int4Config.from_hf(qc)
    qc = F.compressed_tensors_config(128, False)
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights\.num_bits: 8 is not supported"):
        Int4Config.from_hf(qc)
    qc = F.compressed_tensors_config(128, False)
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match=r"group_0\.input_activations: activation quantization is not supported"):
        Int4Config.from_hf(qc)


# ------------------------------------------------------------------------------------ bad checkpoints
def variant(tmp_path, src, name, edit_tensors=None, **config):
    d = str(tmp_path / name)
    shutil.copytree(src, d)
    if edit_tensors is not None:
        tensors = load_file(os.path.join(d, "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    if config:
        with open(os.path.join(d, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        edit_config(d, quantization_config={**qc, **config})
    return d


def test_bad_checkpoints_are_rejected_naming_the_tensor_and_field(tmp_path, built):
    awq, gptq, ct = (built["quantized"][n][0] for n in ("awq", "gptq-v2", "ct"))
    q = "model.layers.0.self_attn.q_proj"
    cases = [
        (variant(tmp_path, awq, "shape", lambda t: t.update({f"{q}.qweight": t[f"{q}.qweight"].t().contiguous()})),
         rf"tensor '{q}\.qweight' has shape \(32, 256\), expected \(256, 32\) \(AutoAWQ GEMM qweight"),
        (variant(tmp_path, gptq, "dtype", lambda t: t.update({f"{q}.qweight": t[f"{q}.qweight"].float()})),
         rf"tensor '{q}\.qweight' has dtype torch\.float32, expected torch\.int32 \(GPTQ qweight"),
        (variant(tmp_path, ct, "scale-dtype", lambda t: t.update({f"{q}.weight_scale": t[f"{q}.weight_scale"].int()})),
         rf"tensor '{q}\.weight_scale' has dtype torch\.int32, expected torch\.float16 or torch\.bfloat16"),
        (variant(tmp_path, ct, "shape-field", lambda t: t.update({f"{q}.weight_shape": torch.tensor([256, 128])})),
         rf"tensor '{q}\.weight_shape' says the weight is \[256, 128\], expected \[256, 256\]"),
        (variant(tmp_path, awq, "missing", lambda t: t.pop("model.layers.1.mlp.down_proj.scales")),
         r"missing tensors: model\.layers\.1\.mlp\.down_proj\.scales$"),
        (variant(tmp_path, awq, "bits", bits=8), r"quantization_config\.bits: 8 is not supported \(INT4 only\)"),
        (variant(tmp_path, gptq, "group", group_size=96),
         r"quantization_config\.group_size: 96: the INT4 kernels' group size must be 32, 64, 128, a multiple of "
         r"128, or K = 256"),
        (variant(tmp_path, gptq, "bias", lambda t: t.update({f"{q}.bias": torch.ones(256)})),
         rf"checkpoint tensor '{q}\.bias' has no place"),
    ]
    for path, error in cases:
        with pytest.raises(ValueError, match=error):
            build(path)
    with pytest.raises(ValueError, match=cases[0][1]):
        engine(cases[0][0])                                  # LLM(...) refuses before it serves
    zero_bias = variant(tmp_path, gptq, "zero-bias", lambda t: t.update({f"{q}.bias": torch.zeros(256)}))
    assert build(zero_bias).model.layers[0].self_attn.qkv_proj.bias is None     # AutoGPTQ's zero biases: skipped


def test_act_order_shards_must_share_g_idx(tmp_path, built):
    path = built["quantized"]["gptq-act-order"][0]
    k = "model.layers.0.self_attn.k_proj.g_idx"
    bad = variant(tmp_path, path, "g_idx", lambda t: t.update({k: t[k].flip(0).contiguous()}))
    with pytest.raises(ValueError, match=r"model: model\.layers\.0\.self_attn\.qkv_proj: g_idx of shard 'k' differs"):
        build(bad)
    uneven = variant(tmp_path, path, "uneven", lambda t: t.update(
        {n: torch.zeros_like(v) for n, v in t.items() if n.startswith("model.layers.1.mlp.down") and "g_idx" in n}))
    with pytest.raises(ValueError, match=r"down_proj: g_idx: every group must hold exactly 64 input rows"):
        build(uneven)


# ------------------------------------------------------------------------------------ dummy and cost
def test_dummy_int4_tables_start_an_engine_without_a_checkpoint(tmp_path):
    cfg_dir = make_random_checkpoint(str(tmp_path / "cfg"), preset="tiny-g128", config_only=True)
    a, b = build(cfg_dir, "int4", "dummy", seed=1), build(cfg_dir, "int4", "dummy", seed=1)
    qkv = a.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int32 and qkv.weight.shape == (256 // 8, 256 + 2 * 128)
    assert torch.equal(qkv.zeros, torch.full_like(qkv.zeros, 8.0)) and qkv.scales.min() > 0
    assert set(unpack_int4(qkv.weight).unique().tolist()) == set(range(16))
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.lm_head.weight.dtype == torch.float32 and a.lm_head.weight.count_nonzero() == a.lm_head.weight.numel()
    llm = engine(cfg_dir, load_format="dummy", quantization="int4", seed=3)
    out = llm.generate([prompt_of(4)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_int4_cost_counts_half_a_byte_and_the_group_tables(built):
    model = build(built["quantized"]["ct"][0])
    step = StepShape((1,), (8,), dtype=torch.bfloat16)
    [gemm] = model.model.layers[0].mlp.gate_up_proj.cost(step)
    assert gemm.param_bytes == 2 * 512 * 256 * (0.5 + 2 * 2 / 128) and gemm.compute == "bf16"
    assert model.model.layers[0].mlp.gate_up_proj.weight_precision(step).name == "int4-g128"


def test_parameter_count_is_the_weights_not_the_packed_words(built):
    """ridge roofline reports a model's size as its model card gives it: an INT4 layer's int32 words
    hold eight weights each, and its scales and zero points are not weights."""
    from ridge.roofline.api import model_weights
    plain, int4 = build(built["src"]["llama"]), build(built["src"]["llama"], quantization="int4")
    assert model_weights(int4) == model_weights(plain) == sum(p.numel() for p in plain.parameters())
    assert sum(p.numel() for p in int4.parameters()) < model_weights(int4)
