"""Quantized mixture-of-experts and latent-attention models end to end on the CPU (issue 19, item 4):
a DeepSeek-V3 checkpoint in the HF fp8 block format (what DeepSeek ships) against transformers on
the dequantized weights; `--quantization int4` on Qwen3-MoE and DeepSeek-V2 against ridge's own
float path on the RTN-dequantized weights. (The expert kernels' formats: tests/models/test_moe.py.)"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ridge import LLM, SamplingParams
from ridge.kernels.moe_quant import Fp8Experts, Int4Experts, dequantize_experts
from ridge.layers.linear import Linear
from ridge.layers.moe import FusedMoE
from ridge.layers.quant.fp8.formats import Fp8BlockConfig, dequantize_fp8_block, quantize_fp8_block
from ridge.layers.quant.int4.experts import quantize_experts_int4
from ridge.layers.quant.int4.formats import dequantize, quantize_rtn
from ridge.layers.quant.int4.linear import Int4Linear
from ridge.utils.random_checkpoint import make_random_checkpoint
from tests.tests_support import prompt_of
from tests.models.test_hf_parity import assert_first_step_logits_match, hf_greedy

# what DeepSeek-V3's checkpoint holds in e4m3 with a weight_scale_inv per 128 x 128 block: every
# projection of attention and of the MLPs (dense, shared and routed experts); the router
# (mlp.gate), norms, embeddings and the LM head stay in the float dtype
FP8_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                   "up_proj", "down_proj")
# V3's layout at dims the 128 x 128 blocks divide (hidden, experts' and dense intermediate sizes),
# with ragged ones beside: q_lora_rank 96 (q_a's rows, q_b's inputs) and kv_a's 128 + 32 rows
V3_FP8 = dict(preset="tiny-g128", intermediate_size=256, moe_intermediate_size=128, q_lora_rank=96, kv_lora_rank=128,
              qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
PROMPTS = [prompt_of(n, salt=i) for i, n in enumerate((3, 21, 40))]


def _fp8_pair(src: str, fp8_dir: str, deq_dir: str) -> None:
    """src converted to the HF fp8 block format (fp8_dir) and its dequantized float twin (deq_dir)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_PROJECTIONS:
            q, scale_inv = quantize_fp8_block(t)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale_inv
            deq[name] = dequantize_fp8_block(q, scale_inv, (128, 128), t.dtype).contiguous()
        else:
            fp8[name] = deq[name] = t
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for out, ts, qc in ((fp8_dir, fp8, Fp8BlockConfig().to_hf()), (deq_dir, deq, None)):
        os.makedirs(out)
        save_file(ts, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**config, "quantization_config": qc} if qc else config, f)
        for entry in os.listdir(src):
            if entry.startswith("tokenizer") or entry == "special_tokens_map.json":
                with open(os.path.join(src, entry), "rb") as a, open(os.path.join(out, entry), "wb") as b:
                    b.write(a.read())


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3fp8")
    src = make_random_checkpoint(str(root / "float"), arch="deepseekv3", **V3_FP8)
    _fp8_pair(src, str(root / "fp8"), str(root / "deq"))
    return str(root / "fp8"), str(root / "deq")


def test_deepseek_v3_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(v3_fp8):
    """The experts keep the checkpoint's e4m3 blocks and scales as stored (no float copy), the rest
    loads dequantized; tokens equal transformers' on the dequantized checkpoint, logits to 1e-4."""
    fp8_dir, deq_dir = v3_fp8
    names = load_file(os.path.join(fp8_dir, "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in names
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in names
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in names and "lm_head.weight_scale_inv" not in names
    llm = LLM(fp8_dir, device="cpu", show_progress=False, max_model_len=256)
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE))
    w13, w2 = moe.weights()
    assert isinstance(w13, Fp8Experts) and w13.q.dtype == torch.float8_e4m3fn and w13.scale.shape == (8, 2, 2)
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and w2.scale.shape == (8, 2, 1)
    # the stored blocks, bit for bit: expert 3's up rows and their scales
    stored = load_file(os.path.join(fp8_dir, "model.safetensors"))
    up = "model.layers.1.mlp.experts.3.up_proj."
    assert torch.equal(w13.q[3, 128:].view(torch.uint8), stored[up + "weight"].view(torch.uint8))
    assert torch.equal(w13.scale[3, 1:], stored[up + "weight_scale_inv"])
    hf = AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    assert_first_step_logits_match(llm.engine, hf, PROMPTS, "deepseekv3-fp8")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    # --quantization fp8: the same expert blocks (not quantized twice), the dense projections FP8 GEMMs
    q = LLM(fp8_dir, device="cpu", show_progress=False, max_model_len=256, quantization="fp8")
    moe8 = next(m for m in q.engine.runner.model.modules() if isinstance(m, FusedMoE))
    assert torch.equal(moe8.weights()[0].q.view(torch.uint8), w13.q.view(torch.uint8))
    out = q.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_expert_blocks_that_do_not_fall_on_the_share_load_dequantized(tmp_path):
    """Experts whose intermediate size 128 does not divide cannot keep the checkpoint's blocks in the
    merged gate/up layout: they load dequantized (float experts), still exact."""
    src = make_random_checkpoint(str(tmp_path / "float"), arch="deepseekv3", **{**V3_FP8, "moe_intermediate_size": 96})
    _fp8_pair(src, str(tmp_path / "fp8"), str(tmp_path / "deq"))
    llm = LLM(str(tmp_path / "fp8"), device="cpu", show_progress=False, max_model_len=256)
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE))
    assert not moe.stores_checkpoint_format and moe.quant is None and moe.w13_weight.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32).eval()
    assert_first_step_logits_match(llm.engine, hf, PROMPTS[:2], "deepseekv3-fp8-ragged")


def test_fp8_expert_checkpoint_errors_name_the_tensor(v3_fp8, tmp_path):
    fp8_dir, _ = v3_fp8
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :0].contiguous()
    bad = tmp_path / "bad"
    bad.mkdir()
    for entry in os.listdir(fp8_dir):
        if entry != "model.safetensors":
            (bad / entry).write_bytes(open(os.path.join(fp8_dir, entry), "rb").read())
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight_scale_inv: expected float32 \[2, 1\]"):
        LLM(str(bad), device="cpu", show_progress=False)
    with pytest.raises(ValueError, match="does not apply to this FP8 checkpoint"):
        LLM(fp8_dir, device="cpu", show_progress=False, quantization="int4")


# -- INT4 at load --------------------------------------------------------------------------------
INT4_MODELS = {
    # every projection's inputs a multiple of the group (128) but V2's dense down projection (320 =
    # 2.5 groups: a short last group, as V2-Lite's 10944); V2: V2-Lite's layout (q_proj, dense layer 0,
    # a shared expert), interleaved rotary rows permuted after quantization
    "qwen3moe": dict(arch="qwen3moe", preset="tiny-g128", moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True),
    "deepseekv2": dict(arch="deepseekv2", preset="tiny-g128", intermediate_size=320, moe_intermediate_size=128,
                       v_head_dim=32),
}


def _rtn_twin(float_llm, int4_llm) -> None:
    """Turn float_llm into the INT4 model's exact float twin: each weight the INT4 model quantized is
    replaced by its RTN dequantization (the dense layers' grid, group 128; the experts' own)."""
    net, qnet = float_llm.engine.runner.model, int4_llm.engine.runner.model
    with torch.no_grad():
        for name, mod in net.named_modules():
            twin = qnet.get_submodule(name)
            if isinstance(mod, Linear) and isinstance(twin.quant_method, Int4Linear):
                w = mod.weight.data
                mod.weight.data = dequantize(*quantize_rtn(w, 128, scale_dtype=w.dtype), 128).to(w.dtype)
            elif isinstance(mod, FusedMoE):
                assert isinstance(twin.weights()[0], Int4Experts)
                for p in (mod.w13_weight, mod.w2_weight):
                    p.data = dequantize_experts(quantize_experts_int4(p.data))


@pytest.mark.parametrize("name", sorted(INT4_MODELS))
def test_int4_moe_models_match_their_rtn_dequantized_twin(tmp_path, name):
    """--quantization int4 on an MoE model: the routed experts as Int4Experts (no float copy), MLA's
    projections but kv_b and the shared and dense MLPs as INT4 linears, the router float; greedy
    tokens equal the float model's on the RTN-dequantized weights, logits close."""
    path = make_random_checkpoint(str(tmp_path / name), **INT4_MODELS[name])
    q = LLM(path, device="cpu", show_progress=False, max_model_len=256, quantization="int4")
    ref = LLM(path, device="cpu", show_progress=False, max_model_len=256)
    net = q.engine.runner.model
    moe = next(m for m in net.modules() if isinstance(m, FusedMoE))
    assert isinstance(moe.weights()[0], Int4Experts) and moe.w13_weight.numel() == 0
    int4 = {n for n, m in net.named_modules() if isinstance(m, Linear) and isinstance(m.quant_method, Int4Linear)}
    floats = {n for n, m in net.named_modules() if isinstance(m, Linear) and m.quant_method is None}
    assert {n.rsplit(".", 1)[-1] for n in floats} <= {"gate", "kv_b_proj", "lm_head"}, floats
    if name == "deepseekv2":
        assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
                "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
                "model.layers.1.mlp.shared_expert.down_proj"} <= int4
        assert "model.layers.1.self_attn.kv_b_proj" in floats
    from ridge.layers.cost import StepShape
    from ridge.roofline.api import model_weights
    assert model_weights(net) == model_weights(ref.engine.runner.model)      # the experts counted, not their codes
    float_moe = next(m for m in ref.engine.runner.model.modules() if isinstance(m, FusedMoE))
    step = StepShape((1,), (1,))
    assert moe.cost(step)[1].param_bytes == pytest.approx(float_moe.cost(step)[1].param_bytes * (0.5 + 8 / 128) / 4)
    _rtn_twin(ref, q)
    lp = []
    for llm in (q, ref):
        engine = llm.engine
        for p in PROMPTS:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
        lp.append(engine.runner.execute(engine.scheduler.schedule()).logits.clone())
        for rid in list(engine.requests):
            engine.abort(rid)
    rel = ((lp[0] - lp[1]).norm() / lp[1].norm()).item()
    assert rel < 1e-4, rel
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, want = (o.generate(PROMPTS, params, use_tqdm=False) for o in (q, ref))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
