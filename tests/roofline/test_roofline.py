"""`ridge roofline`: the command end to end on the CPU, the diagnosis on workloads of known
character (synthetic numbers, and real CPU copies, matmuls and tiny-op loops measured against
this machine's measured ceilings), and the GPU known answers (marked `gpu`). The diagnosis on
synthetic numbers: tests/roofline/test_roofline_diagnose.py."""
import json
import os

import pytest
import torch

from ridge.config import ModelConfig
from ridge.utils.ceilings import Ceilings, load_ceilings
from ridge.layers.cost import OpCost
from ridge.roofline.costs import decode_shape, op_costs, prefill_shape, step_costs
from ridge.roofline.diagnose import LABELS, classify, diagnose_step
from ridge.roofline.measure import instrument_runner
from ridge.roofline.timeline import Timeline, time_step

# ops timed on their own (RoPE + KV write runs inside attention's forward, SiLU-and-mul inside
# down_proj's: the diagnosis charges them there)
TIMED_OPS = ["embed", "norm", "qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", "final_norm",
             "lm_head", "sampling"]


@pytest.fixture(scope="module")
def roofline_env(tmp_path_factory):
    """Ceilings cached in a temporary directory; one torch thread, so that a CPU shared with other
    jobs does not stall on OpenMP barriers (the ceilings are measured, and cached, per thread count)."""
    cache = tmp_path_factory.mktemp("ridge-cache")
    old_dir, old_threads = os.environ.get("RIDGE_CACHE_DIR"), torch.get_num_threads()
    os.environ["RIDGE_CACHE_DIR"] = str(cache)
    torch.set_num_threads(1)
    yield cache
    torch.set_num_threads(old_threads)
    if old_dir is None:
        os.environ.pop("RIDGE_CACHE_DIR", None)
    else:
        os.environ["RIDGE_CACHE_DIR"] = old_dir


@pytest.fixture(scope="module")
def cpu_ceilings(roofline_env):
    return load_ceilings("cpu")


# -- acceptance 1: the command on the CPU ----------------------------------------------------------------
def test_cli_writes_the_four_files(checkpoints, cpu_ceilings, tmp_path, capsys):
    from ridge.cli import main

    out = tmp_path / "rl"
    path = checkpoints("llama")
    rc = main(["roofline", "--model", path, "--device", "cpu", "--out", str(out), "--batch", "1", "4",
               "--context", "64", "--prefill-len", "48", "--reps", "3", "--warmup", "1", "--predict",
               "--predict-batches", "1", "8", "--predict-contexts", "256", "1024"])
    assert rc == 0
    for name in ("report.md", "report.json", "roofline.png", "roofline.svg"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "report.json").read_text())

    c = data["ceilings"]
    assert c["bandwidth_bytes_per_s"] == cpu_ceilings.bandwidth > 0          # the cached measurement
    assert c["matmul_flops_per_s"]["fp32"] == cpu_ceilings.matmul["fp32"] > 0
    assert c["launch_overhead_s"] > 0 and c["key"] == cpu_ceilings.key

    assert [(s["name"], s["summary"]["batch"]) for s in data["steps"]] == [("prefill", 1), ("decode", 1), ("decode", 4)]
    cfg = ModelConfig.from_dir(path)
    for s, shape in zip(data["steps"], [prefill_shape(1, 48, dtype=torch.float32),
                                        decode_shape(1, 64, dtype=torch.float32),
                                        decode_shape(4, 64, dtype=torch.float32)]):
        summ = s["summary"]
        ops = {r["op"]: r for r in s["ops"]}
        assert list(ops) == TIMED_OPS
        assert any("rope_kv_write is not timed on its own" in n for n in s["notes"])
        for r in ops.values():
            assert r["time_s"] > 0 and r["label"] in LABELS, r
            assert r["kernels"] >= 1 and r["calls"] >= 1
            for key in ("flops", "bytes", "intensity", "achieved_flops", "achieved_bandwidth", "fraction", "share",
                        "roof", "ideal_s", "advice"):
                assert key in r
        assert ops["norm"]["calls"] == 2 * cfg.num_layers and ops["final_norm"]["calls"] == 1 and ops["qkv_proj"]["calls"] == cfg.num_layers
        # the sum of the per-op times never exceeds the step time
        op_sum = sum(r["time_s"] for r in s["ops"])
        assert op_sum == pytest.approx(summ["ops_time_s"])
        assert op_sum + summ["host_time_s"] + summ["other_time_s"] <= summ["step_time_s"] * (1 + 1e-9)
        assert sum(r["share"] for r in s["ops"]) <= 1 + 1e-9
        assert summ["idle_fraction"] == pytest.approx(summ["idle_time_s"] / summ["step_time_s"])
        costs = step_costs(cfg, shape)
        assert summ["flops"] == sum(x.flops for x in costs) and summ["bytes"] == sum(x.bytes for x in costs)
        assert summ["mbu"] == pytest.approx(summ["bytes"] / summ["step_time_s"] / c["bandwidth_bytes_per_s"])
        assert summ["mfu"] == pytest.approx(summ["flops"] / summ["step_time_s"] / c["matmul_flops_per_s"]["fp32"])
        assert summ["label"] in LABELS and s["first_target"].startswith("attack")
    assert len(data["predictions"]) == 4 * 2 * 2
    assert {p["precision"] for p in data["predictions"]} == {"bf16", "fp8", "int4", "fp8-kv"}

    png = (out / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 200_000
    svg = (out / "roofline.svg").read_text()
    assert "GB/s" in svg and "(measured copy)" in svg and "fp32 matmul" in svg and "GFLOP/s (this run)" in svg
    md = (out / "report.md").read_text()
    assert "![roofline](roofline.png)" in md and "## decode batch 4, context 64" in md and "## Prediction" in md
    shown = capsys.readouterr().out
    assert "decode batch 1, context 64" in shown and "roofline floor" in shown and "bandwidth" in shown


def test_api_random_sampling_decode_only(checkpoints, cpu_ceilings):
    from ridge.roofline import run_roofline

    rep = run_roofline(checkpoints("qwen3"), device="cpu", batches=[3], context=40, prefill_len=0, reps=2,
                       warmup=1, sampling="random")
    assert [s.name for s in rep.steps] == ["decode"]
    step = rep.step("decode", 3)
    rows = {r.op: r for r in step.rows}
    assert rows["qk_norm"].time_s > 0 and rows["qk_norm"].calls == 2 * 2  # q_norm + k_norm, 2 layers
    assert rows["sampling"].flops == 10 * 3 * 512
    assert step.ops_time_s + step.host_time_s <= step.step_time_s
    with pytest.raises(ValueError, match="context"):
        run_roofline(checkpoints("qwen3"), device="cpu", batches=[1], context=5000, prefill_len=0)


def test_instrumentation_leaves_the_model_as_it_was(tiny_llm, roofline_env):
    from ridge.roofline.measure import build_decode, engine_step_fn, release

    runner = tiny_llm.engine.runner
    backends = [m.backend for m in runner.model.modules() if hasattr(m, "backend")]
    built = build_decode(tiny_llm.engine, 2, 20)
    try:
        tl = Timeline("clock")
        costs = op_costs(runner.model, built.shape)
        with instrument_runner(runner, tl, costs):
            engine_step_fn(tiny_llm.engine, built)(tl)
        # every range is named by the model's own cost(): each op module's, the model's (lm_head)
        assert set(TIMED_OPS) | {"host"} == set(tl.calls)
        assert tl.calls["attention"] == tl.calls["down_proj"] == 2 and tl.calls["norm"] == 4 and not tl.stack
        assert all(tl.times[op] > 0 for op in TIMED_OPS)
    finally:
        release(tiny_llm.engine, built)
    assert not tiny_llm.engine.scheduler.has_work()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in runner.model.modules())
    assert "compute_logits" not in vars(runner.model) and "prepare" not in vars(runner)
    assert "forward" not in vars(runner.model) and not any("forward" in vars(m) for m in runner.model.modules())
    assert [m.backend for m in runner.model.modules() if hasattr(m, "backend")] == backends


def test_a_decode_batch_larger_than_one_prefill_step_is_built_chunk_by_chunk(tiny_llm, monkeypatch):
    """Batch x context over max_num_batched_tokens (a 70B engine's 4,096 at batch 64, 1k context):
    the prompts are filled over several scheduler steps; over max_num_seqs it is refused, named."""
    from ridge.roofline.measure import build_decode, release

    sched = tiny_llm.engine.scheduler
    monkeypatch.setattr(sched, "max_num_batched_tokens", 32)
    built = build_decode(tiny_llm.engine, 3, 30)
    try:
        assert [(i.num_new_tokens, i.start) for i in built.sched.scheduled] == [(1, 29)] * 3
        assert all(s.num_tokens == 30 for s in built.seqs)
    finally:
        release(tiny_llm.engine, built)
    monkeypatch.setattr(sched, "max_num_seqs", 2)
    with pytest.raises(ValueError, match="did not admit all 3 prompts of 29 tokens"):
        build_decode(tiny_llm.engine, 3, 30)
    assert not sched.has_work()


def test_a_new_layer_type_is_timed_by_its_own_cost_name(tiny_llm, roofline_env):
    """A module type the roofline has never heard of, stating its own cost(), gets its own timed
    row (hooks found through cost(), named by it) without any roofline edit."""
    from torch import nn

    from ridge.roofline.costs import merge
    from ridge.roofline.measure import build_decode, release, time_engine_step

    class ToyBlock(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

        def cost(self, step):
            return [OpCost("toy_block", "gemm", sum(c.flops for c in merge(self.inner.cost(step))),
                           sum(c.bytes for c in self.inner.cost(step)))]

    engine = tiny_llm.engine
    layer = engine.runner.model.model.layers[1]
    mlp = layer.mlp
    layer.mlp = ToyBlock(mlp)
    built = build_decode(engine, 1, 12)
    try:
        timing = time_engine_step(engine, built, reps=1, warmup=0)
        costs = step_costs(engine.runner.model, built.shape)
    finally:
        release(engine, built)
        layer.mlp = mlp
    assert timing.op_s["toy_block"] > 0 and timing.calls["toy_block"] == 1
    assert timing.calls["down_proj"] == 1                     # layer 0's MLP only
    s = diagnose_step("decode", built.shape, costs, timing, load_ceilings("cpu"), 1, 12, 1)
    assert {r.op: r for r in s.rows}["toy_block"].time_s == timing.op_s["toy_block"]


def test_ceilings_cache(roofline_env, monkeypatch, tmp_path):
    import ridge.utils.ceilings as ce

    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    made = []

    def fake_measure(device):
        made.append(device)
        return Ceilings("cpu", "fake", ce.device_key(torch.device("cpu")), 1e9 * len(made), {"fp32": 1e10}, 1e-6)

    monkeypatch.setattr(ce, "measure_ceilings", fake_measure)
    a = ce.load_ceilings("cpu")
    b = ce.load_ceilings("cpu")
    assert len(made) == 1 and a.bandwidth == b.bandwidth == 1e9 and os.path.isfile(ce.cache_path("cpu"))
    c = ce.load_ceilings("cpu", remeasure=True)
    assert len(made) == 2 and c.bandwidth == 2e9 and ce.load_ceilings("cpu").bandwidth == 2e9

class _Kineto:
    """A kineto raw event as _attribute_uncorrelated reads it."""
    def __init__(self, name, start, duration, stream=7, cpu=False):
        self._name, self._start, self._dur, self._stream, self._cpu = name, start, duration, stream, cpu

    def name(self): return self._name                                       # noqa: E704
    def start_ns(self): return self._start                                  # noqa: E704
    def duration_ns(self): return self._dur                                 # noqa: E704
    def device_type(self): return "DeviceType.CPU" if self._cpu else "DeviceType.CUDA"  # noqa: E704
    def device_index(self): return 0                                        # noqa: E704
    def device_resource_id(self): return self._stream                       # noqa: E704


def test_a_kernel_launched_early_by_pdl_counts_from_the_end_of_the_kernel_before_it():
    """A PDL dependent starts while the kernel before it runs and waits; that wait is the earlier
    kernel's time. Another stream's overlap is real concurrency and stays."""
    from types import SimpleNamespace
    from collections import defaultdict
    from ridge.roofline.timeline import _attribute_uncorrelated

    events = [_Kineto("ridge.rep/0", 0, 10_000, cpu=True),
              _Kineto("int4_gemm", 100, 1_000),                 # 100 .. 1100
              _Kineto("rmsnorm", 900, 250),                     # launched early: busy 1100 .. 1150
              _Kineto("cublas_gemm", 1_200, 300),               # not a Triton launch: clips what follows
              _Kineto("rmsnorm", 1_400, 200),                   # busy 1500 .. 1600
              _Kineto("shared_expert", 1_000, 400, stream=9)]   # another stream: all 400 counted
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    times, counts = defaultdict(float), defaultdict(int)
    launches = [("int4_gemm", "down_proj"), ("rmsnorm", "norm"), ("rmsnorm", "norm"), ("shared_expert", "shared")]
    _attribute_uncorrelated(prof, times, counts, launches)
    assert times[0, "down_proj"] == pytest.approx(1_000e-9)
    assert times[0, "norm"] == pytest.approx(150e-9) and counts[0, "norm"] == 2
    assert times[0, "shared"] == pytest.approx(400e-9)


# -- known character, measured on this CPU ---------------------------------------------------------
def _measure(fn_by_label: dict, device="cpu", reps=3):
    def step(tl):
        for label, fn in fn_by_label.items():
            with tl.range(label):
                fn()
    return time_step(step, device, reps=reps, warmup=1)


def test_cpu_copy_is_memory_bound(cpu_ceilings):
    n = max(128 << 20, cpu_ceilings.details["bandwidth"]["buffer_bytes"] // 2)
    src = torch.ones(n // 4)
    dst = torch.empty_like(src)
    t = _measure({"copy": lambda: dst.copy_(src)})
    label, fraction, roof = classify(0, 2 * n, t.op_s["copy"], t.kernels["copy"], cpu_ceilings)
    assert (label, roof) == ("memory-bound", "memory"), fraction
    assert t.op_s["copy"] <= t.step_s


def test_cpu_matmul_is_compute_bound(cpu_ceilings):
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = _measure({"matmul": lambda: torch.mm(a, b)})
    label, fraction, roof = classify(2 * n ** 3, 3 * n * n * 4, t.op_s["matmul"], t.kernels["matmul"],
                                     cpu_ceilings, compute="fp32")
    assert (label, roof) == ("compute-bound", "compute"), fraction


def test_cpu_tiny_op_step_is_launch_bound(cpu_ceilings):
    """300 one-element ops: the timeline counts their 300 calls, each costs a few launch overheads
    (the instrumented time sits near LAUNCH_BOUND_FACTOR x the ceilings' eager figure, so which side
    of it one loaded run lands on is noise), and the label follows the rule on either side of it."""
    import dataclasses

    from ridge.roofline.diagnose import LAUNCH_BOUND_FACTOR
    x = torch.zeros(1)

    def tiny():
        for _ in range(300):
            x.mul_(1.0)
    t = _measure({"tiny": tiny})
    assert t.kernels["tiny"] == 300
    per_call = t.op_s["tiny"] / 300
    assert per_call < 20 * cpu_ceilings.launch_overhead, (per_call, cpu_ceilings.launch_overhead)
    cost = OpCost("tiny", "elementwise", 300, 300 * 8, 0, 0, 300, "fp32")
    for factor, label in ((0.75 * LAUNCH_BOUND_FACTOR, "launch-bound"), (1.5 * LAUNCH_BOUND_FACTOR, "implementation-bound")):
        op_s = 300 * factor * cpu_ceilings.launch_overhead
        timed = dataclasses.replace(t, op_s={"tiny": op_s}, step_s=op_s, step_reps_s=[op_s])
        s = diagnose_step("decode", decode_shape(1, 2), [cost], timed, cpu_ceilings, 1, 2, 1)
        assert s.rows[0].label == label, (factor, s.rows[0].label)
    assert diagnose_step("decode", decode_shape(1, 2), [cost], dataclasses.replace(
        t, op_s={"tiny": 300 * cpu_ceilings.launch_overhead}, step_s=300 * cpu_ceilings.launch_overhead),
        cpu_ceilings, 1, 2, 1).label == "launch-bound"


# -- acceptance 2 on a GPU (run through the device tool) -------------------------------------------
@pytest.fixture(scope="module")
def gpu_ceilings(roofline_env):
    return load_ceilings("cuda")


def _classify_gpu(fn, cost: OpCost, ceilings):
    t = _measure({"op": fn}, device="cuda", reps=10)
    return t, classify(cost.flops, cost.bytes, t.op_s["op"], t.kernels["op"], ceilings, cost.compute)


@pytest.mark.gpu
def test_gpu_large_bf16_gemm_is_compute_bound(gpu_ceilings):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t, (label, fraction, _) = _classify_gpu(lambda: a @ b, OpCost("gemm", "gemm", 2 * n ** 3, 3 * n * n * 2, 0, 0, 1, "bf16"),
                                            gpu_ceilings)
    assert label == "compute-bound" and fraction >= 0.8, (fraction, gpu_ceilings.matmul)


@pytest.mark.gpu
def test_gpu_large_copy_is_memory_bound(gpu_ceilings):
    n = 768 << 20
    src = torch.ones(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t, (label, fraction, _) = _classify_gpu(lambda: dst.copy_(src), OpCost("copy", "elementwise", 0, 2 * n, 0, 0, 1, "bf16"),
                                            gpu_ceilings)
    assert label == "memory-bound", fraction


@pytest.mark.gpu
def test_gpu_batch1_decode_gemm_is_memory_bound(gpu_ceilings):
    """The 8B shape's gate/up projection at batch 1: 235 MB of weights for 0.47 GFLOP."""
    h, inter = 4096, 14336
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, h, device="cuda", dtype=torch.bfloat16)
    cost = OpCost("gate_up", "gemm", 2 * h * 2 * inter, (2 * inter * h + h + 2 * inter) * 2, 0, 0, 1, "bf16")
    t, (label, fraction, _) = _classify_gpu(lambda: torch.nn.functional.linear(x, w), cost, gpu_ceilings)
    assert label == "memory-bound", fraction


@pytest.mark.gpu
def test_gpu_tiny_kernel_step_is_launch_bound(gpu_ceilings):
    x = torch.zeros(1, device="cuda")

    def tiny():
        for _ in range(500):
            x.add_(1)
    t = _measure({"tiny": tiny}, device="cuda", reps=5)
    assert abs(t.kernels["tiny"] - 500) <= 1   # a stray kernel of the harness may land in one rep
    s = diagnose_step("decode", decode_shape(1, 2), [OpCost("tiny", "elementwise", 500, 500 * 8, 0, 0, 500, "fp32")], t,
                      gpu_ceilings, 1, 2, 1)
    assert s.rows[0].label == "launch-bound" and s.label == "launch-bound"


@pytest.mark.gpu
def test_gpu_cli_on_a_small_checkpoint(checkpoints, gpu_ceilings, tmp_path):
    from ridge.cli import main

    out = tmp_path / "rl-gpu"
    assert main(["roofline", "--model", checkpoints("llama"), "--device", "cuda", "--out", str(out),
                 "--batch", "1", "8", "--context", "256", "--prefill-len", "256", "--reps", "5"]) == 0
    data = json.loads((out / "report.json").read_text())
    for s in data["steps"]:
        summ = s["summary"]
        assert sum(r["time_s"] or 0 for r in s["ops"]) + summ["host_time_s"] + summ["other_time_s"] \
            <= summ["step_time_s"] * (1 + 1e-9)
        # every op's kernels were attributed by the profiler (no CUDA-event fallback)
        assert all(r["time_s"] and r["kernels"] is not None and r["kernels"] >= 1 for r in s["ops"]), s["ops"]
        assert not any("no kernels attributed" in n for n in s["notes"]), s["notes"]
    decode = [s for s in data["steps"] if s["name"] == "decode"]
    assert decode and all(s["summary"]["cuda_graph"] for s in decode)   # the Triton backend replays graphs
