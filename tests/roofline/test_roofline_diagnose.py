"""`ridge roofline`'s diagnosis on synthetic numbers of known character (labels, a step's
diagnosis, untimed fused ops folded into their hosts) and the CUDA-event timeline's bookkeeping
with a fake clock: no model, no device. The command end to end and measured workloads:
tests/roofline/test_roofline.py."""
import pytest
import torch

from ridge.config import ModelConfig
from ridge.utils.ceilings import Ceilings
from ridge.layers.cost import OpCost
from ridge.roofline.costs import decode_shape, prefill_shape, step_costs
from ridge.roofline.diagnose import BOUND_FRACTION, LAUNCH_BOUND_FACTOR, classify, diagnose_step
from ridge.roofline.timeline import StepTiming, Timeline


def fake_ceilings(launch=5e-6, graph=1e-6) -> Ceilings:
    return Ceilings("cuda", "fake GPU", "fake", 1e12, {"bf16": 100e12, "fp8": 200e12, "fp32": 50e12}, launch, graph)


# -- diagnosis on synthetic numbers of known character ----------------------------------------------
def test_labels_from_known_intensity_and_time():
    c = fake_ceilings()      # 1 TB/s, bf16 100 TFLOP/s (ridge at 100 FLOP/byte), launch 5 us
    # AI 1: memory roof, 1 GB in 1 ms at the roof
    assert classify(1e9, 1e9, 1.25e-3, 10, c) == ("memory-bound", pytest.approx(0.8), "memory")
    # AI 1e5: compute roof, 1e14 FLOPs in 1 s at the roof
    assert classify(1e14, 1e9, 1.1, 10, c)[:1] == ("compute-bound",)
    assert classify(1e14, 1e9, 1.1, 10, c)[1] == pytest.approx(1 / 1.1)
    # 10x slower than the roof on either side
    assert classify(1e9, 1e9, 1e-2, 10, c)[0] == "implementation-bound"
    assert classify(1e14, 1e9, 10.0, 10, c)[0] == "implementation-bound"
    # the boundary
    assert classify(1e9, 1e9, 1e-3 / (BOUND_FRACTION + 0.01), 1, c)[0] == "memory-bound"
    assert classify(1e9, 1e9, 1e-3 / (BOUND_FRACTION - 0.01), 1, c)[0] == "implementation-bound"
    # a kernel of 3 us against a 5 us launch: launch-bound; at 20 us it is not
    assert classify(1e3, 1e3, 3e-6, 1, c)[0] == "launch-bound"
    assert classify(1e3, 1e3, 100 * 3e-6, 100, c)[0] == "launch-bound"
    assert classify(1e3, 1e3, 20e-6, 1, c)[0] == "implementation-bound"
    assert classify(1e3, 1e3, LAUNCH_BOUND_FACTOR * 5e-6 * 1.01, 1, c)[0] != "launch-bound"
    # inside a CUDA graph the in-graph launch cost (1 us) applies
    assert classify(1e3, 1e3, 3e-6, 1, c, graph=True)[0] == "implementation-bound"
    # FP8 GEMM against the fp8 roof
    assert classify(2e14, 1e9, 1.0, 1, c, compute="fp8")[0] == "compute-bound"


def test_step_diagnosis_from_known_timings():
    c = fake_ceilings()
    costs = [OpCost("gemm", "gemm", 1e12, 1e9, 1e9, 0, 1, "bf16"),        # roof: 10 ms compute
             OpCost("copy", "elementwise", 0, 4e9, 0, 0, 1, "bf16"),              # roof: 4 ms memory
             OpCost("tiny", "elementwise", 1e3, 1e3, 0, 0, 50, "bf16")]           # 50 launches
    timing = StepTiming(step_s=40e-3, op_s={"gemm": 11e-3, "copy": 5e-3, "tiny": 50 * 3e-6, "host": 1e-3},
                        calls={"gemm": 1, "copy": 1, "tiny": 50}, kernels={"gemm": 1, "copy": 1, "tiny": 50})
    s = diagnose_step("decode", decode_shape(1, 8), costs, timing, c, 1, 8, 1)
    rows = {r.op: r for r in s.rows}
    assert rows["gemm"].label == "compute-bound" and rows["gemm"].fraction == pytest.approx(10 / 11)
    assert rows["copy"].label == "memory-bound" and rows["copy"].fraction == pytest.approx(0.8)
    assert rows["tiny"].label == "launch-bound"
    assert s.ops_time_s == pytest.approx(16.15e-3) and s.host_time_s == 1e-3
    assert s.idle_time_s == pytest.approx(40e-3 - 16.15e-3 - 1e-3)
    assert rows["gemm"].share == pytest.approx(11 / 40)
    assert s.mfu == pytest.approx((1e12 + 1e3) / 40e-3 / 100e12)
    assert s.mbu == pytest.approx((1e9 + 4e9 + 1e3) / 40e-3 / 1e12)
    assert s.predicted_s == pytest.approx(10e-3 + 4e-3 + 1e3 / 1e12)
    # 22.85 ms of the step is outside every op: launch-bound, and the gaps are the first target
    assert s.label == "launch-bound" and "launch/idle" in s.first_target
    assert any("CUDA graphs" in a for a in s.advice)
    assert "FP8" in rows["gemm"].advice
    # a step with almost no gaps and a GEMM 2 ms above its roof: the GEMM is what to attack
    busy = StepTiming(step_s=18.2e-3, op_s={"gemm": 12e-3, "copy": 5e-3, "tiny": 50 * 3e-6, "host": 1e-3},
                      calls=timing.calls, kernels=timing.kernels)
    s2 = diagnose_step("prefill", prefill_shape(1, 8), costs, busy, c, 1, 8, 8)
    assert s2.idle_time_s == pytest.approx(0.05e-3)
    assert s2.label == "compute-bound" and s2.first_target.startswith("attack gemm first")


@pytest.mark.parametrize("part,hosts,untimed", [("rope_kv_write", ("attention",), "absent"),
                                                ("activation", ("down_proj",), "absent"),
                                                ("activation", ("down_proj",), "zero")])
def test_untimed_fused_op_folds_into_its_hosts(part, hosts, untimed):
    """An op with no time of its own, run inside the forward of a module that hosts a timed op
    (RoPE + KV write inside attention; SiLU-and-mul inside down_proj, fused into its GEMV at
    batch 1), is charged to that module's timed op(s), split evenly between them."""
    c = fake_ceilings()
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    cfg_costs = step_costs(cfg, decode_shape(1, 4))
    times = {o.name: 1e-3 for o in cfg_costs if o.name != part}
    if untimed == "zero":
        times[part] = 0.0
    s = diagnose_step("decode", decode_shape(1, 4), cfg_costs,
                      StepTiming(20e-3, times, {}, {}), c, 1, 4, 1)
    rows = {r.op: r for r in s.rows}
    inner = next(o for o in cfg_costs if o.name == part)
    assert part not in rows and any(n.startswith(part) or f"{part}s" in n for n in s.notes)
    for host in hosts:
        outer = next(o for o in cfg_costs if o.name == host)
        assert rows[host].bytes == pytest.approx(outer.bytes + inner.bytes / len(hosts))
        assert rows[host].flops == pytest.approx(outer.flops + inner.flops / len(hosts))
    assert sum(r.bytes for r in s.rows) == pytest.approx(sum(o.bytes for o in cfg_costs))
    assert "final_norm" in rows



def test_event_timeline_exclusive_times(monkeypatch):
    """The CUDA-event fallback's bookkeeping, with a fake clock standing in for the device."""
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    tl = Timeline("events")
    for _ in range(2):
        with tl.range("attention"):
            clock[0] += 1.0
            with tl.range("kv_write"):
                clock[0] += 0.25
            clock[0] += 2.0
        clock[0] += 10.0                         # outside every range
        with tl.range("o_proj"):
            clock[0] += 0.5
    tl.collect()
    assert dict(tl.times) == {"attention": 6.0, "kv_write": 0.5, "o_proj": 1.0}
    assert tl.calls == {"attention": 2, "kv_write": 2, "o_proj": 2} and not tl.stack
