"""The costs the model's layers state (summed by the roofline) against numbers worked out by
hand, and against the checkpoints."""
import dataclasses
import json
import os

import pytest
import torch

from ridge.config import ModelConfig
from ridge.layers.attention import attention_keys_read, attention_pairs
from ridge.layers.cost import OpCost, StepShape
from ridge.utils.ceilings import Ceilings
from ridge.roofline.costs import (PRECISIONS, decode_shape, kv_bytes_per_token, parameter_bytes, prefill_shape,
                                  step_costs, utilization)
from ridge.roofline.predict import launch_floor_s, predict, predicted_step_s
from tests.tests_support import REPO

OPS = ("embed", "norm", "qkv_proj", "qk_norm", "rope_kv_write", "attention", "o_proj",
       "gate_up_proj", "activation", "down_proj", "final_norm", "lm_head", "sampling")


def as_(precision: str, step: StepShape) -> StepShape:
    return PRECISIONS[precision].shape(step)

# hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 512, untied, no biases
SMALL = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             max_position_embeddings=1024)


def small_cfg(**over) -> ModelConfig:
    return ModelConfig.from_dict({**SMALL, **over})


def by_name(costs):
    return {c.name: c for c in costs}


def test_decode_step_by_hand():
    """Batch 2 decode at context 10, bf16 (2 bytes for weights, activations and KV)."""
    c = by_name(step_costs(small_cfg(), decode_shape(2, 10)))
    assert list(c) == [o for o in OPS if o != "qk_norm"]
    # T = 2 tokens, N = 2 sampled rows, h = 64, I = 128, q = 64, kv = 32, d = 16, L = 2, V = 512
    expected = {
        #                flops                       bytes
        "embed":        (0,                          2 * 2 * 64 * 2),
        # 4 norms in the layers: layer 0's input (4 FLOP/elt, read x + write), 3 with residual (5,
        # read 2 + write 2); 4 weight vectors
        "norm":         (2 * 64 * (4 + 5 * 3),       2 * 64 * 2 * (2 + 4 * 3) + 4 * 64 * 2),
        # the final one, with residual but no residual output (5, read 2 + write 1); its weight
        "final_norm":   (2 * 64 * 5,                 2 * 64 * 2 * 3 + 64 * 2),
        "qkv_proj":     (2 * (2 * 2 * 64 * 128),     2 * (64 * 128 * 2 + 2 * 64 * 2 + 2 * 128 * 2)),
        # read q, k, v (2 x 128 elements), write q, k (2 x 96), the tables (2 x 16 x 4 bytes),
        # the K/V rows (2 x 64)
        "rope_kv_write": (2 * (3 * 2 * 6 * 16),      2 * (2 * (128 + 96) * 2 + 2 * 16 * 4 + 2 * 64 * 2)),
        # 20 (row, key) pairs (2 sequences x 10 keys); Q + O, then 10 keys x (K + V) per sequence
        "attention":    (2 * (4 * 4 * 16 * 20),      2 * (2 * 2 * 64 * 2 + 20 * 2 * 32 * 2)),
        "o_proj":       (2 * (2 * 2 * 64 * 64),      2 * (64 * 64 * 2 + 2 * 64 * 2 + 2 * 64 * 2)),
        "gate_up_proj": (2 * (2 * 2 * 64 * 256),     2 * (64 * 256 * 2 + 2 * 64 * 2 + 2 * 256 * 2)),
        "activation":   (2 * (5 * 2 * 128),          2 * (3 * 2 * 128 * 2)),
        "down_proj":    (2 * (2 * 2 * 128 * 64),     2 * (128 * 64 * 2 + 2 * 128 * 2 + 2 * 64 * 2)),
        "lm_head":      (2 * 2 * 64 * 512,           512 * 64 * 2 + 2 * 64 * 2 + 2 * 512 * 4),
        "sampling":     (2 * 512,                    2 * 512 * 4),
    }
    literal = {"norm": (2432, 4096), "final_norm": (640, 896), "qkv_proj": (65536, 34304), "rope_kv_write": (1152, 2560),
               "attention": (10240, 6144), "o_proj": (32768, 17408), "gate_up_proj": (131072, 68096),
               "activation": (2560, 3072), "down_proj": (65536, 34304), "lm_head": (131072, 69888)}
    for name, (flops, nbytes) in expected.items():
        assert (c[name].flops, c[name].bytes) == (flops, nbytes), name
    for name, (flops, nbytes) in literal.items():
        assert (c[name].flops, c[name].bytes) == (flops, nbytes), name
    assert c["qkv_proj"].param_bytes == 2 * 64 * 128 * 2
    assert c["attention"].kv_bytes == 20 * 2 * 32 * 2 * 2 and c["rope_kv_write"].kv_bytes == 2 * 2 * 64 * 2
    assert c["norm"].calls == 4 and c["final_norm"].calls == 1 and c["qkv_proj"].calls == 2 and c["lm_head"].calls == 1


def test_prefill_and_precisions_by_hand():
    cfg = small_cfg()
    c = by_name(step_costs(cfg, prefill_shape(1, 8)))
    # causal: 1 + 2 + ... + 8 = 36 pairs; K/V of 8 tokens read once; only the last row samples
    assert c["attention"].flops == 2 * 4 * 4 * 16 * 36
    assert c["attention"].bytes == 2 * (2 * 8 * 64 * 2 + 8 * 2 * 32 * 2)
    assert c["lm_head"].flops == 2 * 1 * 64 * 512
    assert c["qkv_proj"].flops == 2 * 2 * 8 * 64 * 128
    # INT4 weights (group 128, 16-bit scale): 0.515625 bytes a weight; the LM head stays 16-bit
    i4 = by_name(step_costs(cfg, as_("int4", decode_shape(1, 4))))
    assert i4["down_proj"].param_bytes == 2 * 128 * 64 * (0.5 + 2 / 128)
    assert i4["lm_head"].param_bytes == 512 * 64 * 2 and i4["lm_head"].compute == "bf16"
    # FP8 KV: the attention's cache reads and the KV write's stores halve
    f8 = by_name(step_costs(cfg, as_("fp8-kv", decode_shape(1, 4))))
    assert f8["attention"].kv_bytes == 4 * 2 * 32 * 1 * 2
    assert f8["rope_kv_write"].bytes == 2 * (1 * (128 + 96) * 2 + 16 * 4 + 1 * 64 * 1)
    fp8 = by_name(step_costs(cfg, as_("fp8", decode_shape(1, 4))))
    assert fp8["o_proj"].compute == "fp8" and fp8["o_proj"].param_bytes == 2 * 64 * 64 * (1 + 4 / 128 ** 2)
    # random sampling: 10 FLOPs a logit
    r = by_name(step_costs(cfg, decode_shape(3, 4, greedy=False)))
    assert r["sampling"].flops == 10 * 3 * 512


def test_biases_and_qk_norm_by_hand():
    cfg = small_cfg(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, head_dim=16)
    c = by_name(step_costs(cfg, decode_shape(1, 4)))
    # per layer: q_norm over 4 heads, k_norm over 2 heads, rows of 16: 4 FLOPs an element
    assert c["qk_norm"].flops == 2 * 4 * 6 * 16 and c["qk_norm"].calls == 4
    assert c["qk_norm"].bytes == 2 * (2 * 6 * 16 * 2 + 2 * 16 * 2)
    q2 = by_name(step_costs(small_cfg(architectures=["Qwen2ForCausalLM"]), decode_shape(1, 4)))
    assert q2["qkv_proj"].flops == 2 * (2 * 64 * 128 + 128)          # bias: one add per output
    assert q2["qkv_proj"].param_bytes == 2 * (64 * 128 + 128) * 2


def test_attention_pairs_match_brute_force():
    for q in (1, 2, 5, 16):
        for ctx in range(q, 40, 3):
            for window in (None, 1, 3, 8, 100):
                pos = range(ctx - q, ctx)
                brute = sum(len([k for k in range(p + 1) if window is None or k > p - window]) for p in pos)
                assert attention_pairs(q, ctx, window) == brute, (q, ctx, window)
                keys = {k for p in pos for k in range(p + 1) if window is None or k > p - window}
                assert attention_keys_read(q, ctx, window) == len(keys), (q, ctx, window)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_parameter_bytes_match_the_checkpoint(checkpoints, arch):
    """The weights the cost model reads per step are exactly the checkpoint's tensors."""
    from safetensors import safe_open

    path = checkpoints(arch)
    cfg = ModelConfig.from_dir(path)
    numel = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    shape = f.get_slice(key).get_shape()
                    n = 1
                    for s in shape:
                        n *= s
                    numel += n
    fp32 = decode_shape(1, 8, dtype=torch.float32)
    assert parameter_bytes(cfg, fp32) == 4 * numel
    # a decode step reads every parameter once, except the rows of the embedding table it does
    # not look up (when the LM head does not share that table)
    costs = step_costs(cfg, fp32)
    read = sum(c.param_bytes for c in costs if c.name != "embed")
    table = cfg.vocab_size * cfg.hidden_size * 4
    assert read == 4 * numel - (0 if cfg.tie_word_embeddings else table)


def test_step_shape_validation_and_scheduler_shape():
    with pytest.raises(ValueError):
        StepShape((2,), (1,))
    with pytest.raises(ValueError):
        StepShape((), ())
    s = StepShape((1, 1, 7), (30, 12, 7), num_sampled=2)
    assert (s.num_tokens, s.num_seqs, s.sampled_rows, s.num_decode_seqs, s.num_prefill_tokens) == (9, 3, 2, 2, 7)


def fake_ceilings(bandwidth=1e12, bf16=100e12, fp8=200e12, fp32=50e12, launch=5e-6) -> Ceilings:
    return Ceilings("cuda", "fake", "fake", bandwidth, {"bf16": bf16, "fp8": fp8, "fp32": fp32}, launch, 1e-6)


def test_prediction_and_utilization_by_hand():
    cfg = small_cfg()
    ceil = fake_ceilings()
    shape = decode_shape(2, 10)
    costs = step_costs(cfg, shape)
    floor = sum(max(c.flops / ceil.peak(c.compute), c.bytes / ceil.bandwidth) for c in costs)
    assert predicted_step_s(cfg, ceil, shape) == pytest.approx(floor)
    # + one launch floor (the graph figure, 1 us here) per op call: the cost model's kernel count
    calls = sum(c.calls for c in costs)
    # embed, 2 norms a layer, then per layer (2 layers) qkv, rope_kv_write, attention, o_proj,
    # gate_up, activation, down; the final norm; lm_head; sampling
    assert calls == 1 + 2 * 2 + 2 * 7 + 1 + 1 + 1
    assert predicted_step_s(cfg, ceil, shape, with_launches=True) == pytest.approx(floor + calls * 1e-6)
    assert launch_floor_s(ceil) == 1e-6
    assert launch_floor_s(dataclasses.replace(ceil, graph_launch=None)) == 5e-6   # eager where no graph figure
    # tiny decode: every op is on the memory side, so the floor is bytes / bandwidth
    assert floor == pytest.approx(sum(c.bytes for c in costs) / 1e12)
    flops = 3072 + 65536 + 1152 + 10240 + 32768 + 131072 + 2560 + 65536 + 131072 + 1024
    nbytes = 512 + 4992 + 34304 + 2560 + 6144 + 17408 + 68096 + 3072 + 34304 + 69888 + 4096
    mfu, mbu = utilization(costs, 1e-6, ceil)
    # every op at the bf16 roof but sampling's 1,024 FLOPs (fp32 math) at the fp32 roof
    assert [c.flops for c in costs if c.compute != "bf16"] == [1024] and costs[-1].compute == "fp32"
    assert mfu == pytest.approx(((flops - 1024) / 100e12 + 1024 / 50e12) / 1e-6)
    assert mbu == pytest.approx(nbytes / 1e-6 / 1e12)
    with pytest.raises(ValueError):
        utilization(costs, 0.0, ceil)
    # each op's FLOPs at its own matrix peak: FP8 projections at the FP8 roof, the rest at bf16's
    mixed = [OpCost("gate_up", "gemm", 2e9, 0.0, compute="fp8"), OpCost("attention", "attention", 1e9, 0.0),
             OpCost("all_reduce", "collective", 0.0, 0.0, compute="link")]
    ceil8 = fake_ceilings(bf16=100e12, fp8=200e12)
    assert utilization(mixed, 1e-4, ceil8)[0] == pytest.approx((2e9 / 200e12 + 1e9 / 100e12) / 1e-4)


def test_prediction_grid_behaves_like_napkin_math():
    cfg = ModelConfig.from_dict(json.loads(json.dumps({
        **SMALL, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192})))
    ceil = fake_ceilings(bandwidth=4e12, bf16=800e12, fp8=1600e12)
    rows = predict(cfg, ceil, batches=(1, 64), contexts=(4096,), precisions=("bf16", "int4", "fp8-kv"),
                   kv_budget=40e9)
    r = {(p.precision, p.batch): p for p in rows}
    # batch 1: the 16.06 GB of weights less the embedding table (1.05 GB, only one row read),
    # plus 4096 tokens x 128 KiB of KV, over 4 TB/s: ~3.9 ms; INT4 cuts the weight bytes ~3.9x
    weights = parameter_bytes(cfg) - 128256 * 4096 * 2
    assert weights == pytest.approx(15.01e9, rel=1e-3)
    assert r["bf16", 1].decode_s == pytest.approx((weights + 4096 * 131072) / 4e12, rel=0.01)
    assert r["bf16", 1].decode_bound == "weights"
    # INT4: the layers' weights shrink to 0.515625 / 2 of their bytes; LM head, norms and KV do not
    head, norms = 128256 * 4096 * 2, (2 * 32 + 1) * 4096 * 2
    int4 = (weights - head - norms) * 0.515625 / 2 + head + norms + 4096 * 131072
    assert r["int4", 1].decode_s == pytest.approx(int4 / 4e12, rel=0.01)
    assert 2.8 < r["bf16", 1].decode_s / r["int4", 1].decode_s < 3.2
    # batch 64 at 4k: 64 x 4096 x 128 KiB of KV (34 GB) outweighs the weights
    assert r["bf16", 64].decode_bound == "KV cache"
    assert r["fp8-kv", 64].decode_s < r["bf16", 64].decode_s
    # max batch: 40 GB / (4096 tokens x 128 KiB) = 74 sequences; FP8 KV doubles it
    per_seq = 4096 * kv_bytes_per_token(cfg)
    assert per_seq == 4096 * 2 * 32 * 1024 * 2
    assert r["bf16", 64].max_batch == int(40e9 // per_seq) == 74 and r["bf16", 64].fits
    assert r["fp8-kv", 64].max_batch == int(40e9 // (per_seq / 2))
    # prefill of 4k tokens is compute-bound: ~2 x 8B x 4096 FLOPs at 800 TFLOP/s
    assert r["bf16", 1].prefill_s > 2 * 7e9 * 4096 / 800e12
    with pytest.raises(ValueError):
        predict(cfg, ceil, precisions=("int3",))


LLAMA_8B = {**SMALL, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192}


def test_8b_decode_step_is_parameters_plus_kv_by_hand():
    """Llama-3-8B shape, bf16, batch 1 at context 4096: the step reads every weight once (the
    embedding table but one row), the 4096 tokens' K/V of every layer, and a little else."""
    cfg = ModelConfig.from_dict(LLAMA_8B)
    h, inter, L, V, kv = 4096, 14336, 32, 128256, 8 * 128
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h          # qkv, o, gate/up + down, 2 norms
    params = 2 * (L * per_layer + 2 * V * h + h)                           # + embedding, LM head, final norm
    assert parameter_bytes(cfg) == params == pytest.approx(16.06e9, rel=1e-3)
    kv_read = 4096 * L * 2 * kv * 2
    assert kv_bytes_per_token(cfg) == L * 2 * kv * 2 == 131072
    costs = step_costs(cfg, decode_shape(1, 4096))
    assert sum(c.param_bytes for c in costs) == params - 2 * (V - 1) * h
    assert sum(c.kv_bytes for c in costs) == kv_read + kv_bytes_per_token(cfg)      # read 4096, write 1
    nbytes = sum(c.bytes for c in costs)
    assert params - 2 * V * h + kv_read < nbytes < 1.001 * (params - 2 * V * h + kv_read)
    # 2 FLOPs a weight of the layers and the head, plus attention's 4 * head_dim per (head, key)
    gemm = 2 * (L * (per_layer - 2 * h) + V * h)
    flops = sum(c.flops for c in costs)
    assert gemm + 4 * 128 * 32 * 4096 * L < flops < 1.001 * (gemm + 4 * 128 * 32 * 4096 * L)


def meta_llama(cfg):
    from ridge.roofline.costs import meta_model
    import copy
    return copy.deepcopy(meta_model(cfg))


def test_a_new_layer_type_brings_its_cost_with_it():
    """A quantised Linear and an MoE-like block, each with its own cost(), swapped into the model:
    the roofline's sums, predictions and op list follow without any roofline edit."""
    from torch import nn

    from ridge.layers.cost import OpCost, Precision, child
    from ridge.layers.activation import SiluAndMul
    from ridge.layers.linear import Linear

    class Int4Linear(Linear):
        def weight_precision(self, step, rows=None):
            return Precision("int4", 0.5 + 2 / 128, "bf16")

    class ToyExperts(nn.Module):
        """top-2 of 4 experts, each [h -> h]: reads the chosen experts' weights."""
        def __init__(self, h):
            super().__init__()
            self.router = Linear(h, 4)
            self.w = nn.Parameter(torch.empty(4, h, h), requires_grad=False)

        def cost(self, step):
            h, T = self.w.shape[-1], step.num_tokens
            read = min(4, 2 * T) * h * h * self.w.element_size()
            return child("router", self.router.cost(step), "router") + [
                OpCost("experts", "gemm", 2 * 2 * T * h * h, read + 2 * T * h * 2 * step.act.bytes, read)]

    cfg = small_cfg()
    step = decode_shape(1, 8)
    model = meta_llama(cfg)
    before = by_name(step_costs(model, step))
    with torch.device("meta"):
        q = Int4Linear(128, 64, input_act=SiluAndMul())
        model.model.layers[0].mlp.down_proj = q.to(torch.bfloat16)
        for layer in model.model.layers:
            layer.mlp = ToyExperts(64).to(torch.bfloat16)
    after = by_name(step_costs(model, step))
    assert "experts" in after and "router" in after and "gate_up_proj" not in after
    assert after["experts"].param_bytes == 2 * (2 * 64 * 64 * 2) and after["experts"].calls == 2
    assert after["router"].param_bytes == 2 * 4 * 64 * 2
    assert after["attention"] == before["attention"] and after["lm_head"] == before["lm_head"]
    ceil = fake_ceilings()
    assert predicted_step_s(model, ceil, step) == pytest.approx(
        sum(max(c.flops / ceil.peak(c.compute), c.bytes / ceil.bandwidth) for c in after.values()))
    # the quantised linear alone: only its own weight bytes change
    model = meta_llama(cfg)
    with torch.device("meta"):
        model.model.layers[0].mlp.down_proj = Int4Linear(128, 64, input_act=SiluAndMul()).to(torch.bfloat16)
    q4 = by_name(step_costs(model, step))
    assert q4["down_proj"].param_bytes == 128 * 64 * (0.5 + 2 / 128) + 128 * 64 * 2
    assert {k: v for k, v in q4.items() if k != "down_proj"} == {k: v for k, v in before.items() if k != "down_proj"}


def test_mbu_and_mfu_are_computed_in_one_place():
    """Every MBU / MFU in ridge comes from ridge.roofline.costs.utilization."""
    import re

    root = os.path.join(REPO, "ridge")
    computed = []
    for d, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        # "mbu = ..." with a division, or anything / a time / a ceiling
                        if re.search(r"\bm[fb]u\w*\s*=[^=]*/|/\s*[\w.]+\s*/\s*ceilings\.(bandwidth|peak)", line):
                            computed.append((name, line.strip()))
    assert [n for n, _ in computed] == ["costs.py", "costs.py"], computed
