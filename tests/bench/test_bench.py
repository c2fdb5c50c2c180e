"""`ridge bench latency`, `ridge bench throughput`, the ShareGPT loader and benchmarks/engine/fast_path.py,
on the CPU with the tiny checkpoint and tiny sizes."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ridge.cli import main

from tests.tests_support import REPO as ROOT
# A small KV pool: the CPU default (1 GiB) spends the run faulting in fresh pages.
SMALL_KV = ["--kv-cache-memory", "4e6"]


@pytest.fixture(autouse=True)
def roofline_cache(tmp_path_factory, monkeypatch):
    """Measured ceilings go to a per-session directory, not the user's cache."""
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ridge-cache"))


@pytest.fixture(scope="module")
def tiny(checkpoints):
    return checkpoints("llama")


def run_cli(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


# -- latency -------------------------------------------------------------------------------------------
def test_latency_json_and_table(tiny, tmp_path, capsys):
    path = tmp_path / "lat.json"
    rc, out, err = run_cli(["bench", "latency", "--model", tiny, "--device", "cpu", "--batch-size", "2",
                            "--input-len", "8", "--output-len", "4", "--num-iters", "2", "--warmup-iters", "1",
                            "--roofline", "--no-progress", "--json", str(path)] + SMALL_KV, capsys)
    assert rc == 0, err
    r = json.loads(path.read_text())
    assert r["benchmark"] == "latency"
    assert r["config"] == dict(batch_size=2, input_len=8, output_len=4, num_iters=2, warmup_iters=1,
                               temperature=0.0, seed=0, ignore_eos=True, roofline=True)
    assert r["output_tokens_per_iter"] == [2 * 4, 2 * 4]
    assert r["prefill_steps_per_iter"] == [1, 1]            # 2 x 8 prompt tokens fit one step
    assert r["decode_steps_per_iter"] == [3, 3]             # tokens 2..4 of each request
    ttft, itl, e2e = r["ttft_s"], r["itl_s"], r["e2e_s"]
    assert itl["n"] == 6 and ttft["n"] == 2 and e2e["n"] == 2
    assert 0 < ttft["median"] < e2e["median"] and 0 < itl["min"] <= itl["median"] <= itl["max"] < e2e["max"]
    assert r["output_tokens_per_s"] == pytest.approx(8 / e2e["median"])
    assert r["decode_tokens_per_s"] == pytest.approx(6 * 2 / (itl["mean"] * 6))
    assert 0 < r["mbu"] < 2 and 0 < r["mfu"] < 2
    roof = r["roofline"]
    assert roof["decode_steps"] == 6 and roof["decode_time_s"] == pytest.approx(itl["mean"] * 6)
    # MBU x bandwidth x time = the bytes the decode steps move: the weights and KV they read, plus
    # a little activation and logit traffic at batch 2
    moved = r["mbu"] * roof["bandwidth"] * roof["decode_time_s"] / roof["decode_steps"]
    read = roof["weight_bytes_per_step"] + roof["kv_bytes_per_step"]
    assert read < moved < 1.3 * read
    assert r["preemptions"] == 0
    assert r["env"]["device_type"] == "cpu" and r["env"]["dtype"] == "float32"
    assert "TTFT (ms), median" in out and "MBU (decode)" in out and "MFU (decode)" in out
    # the torch backend (the CPU default) has no static decode path, so no step can overlap
    assert r["overlap_fraction"] == 0.0 and r["static_decode_steps"] == r["overlapped_decode_steps"] == 0
    assert "overlapped decode steps" in out


def test_latency_reports_overlapped_decode_steps(tiny):
    """Batch-1 greedy decode with the default settings on the static decode path (the Triton
    backend, interpreted on a CPU): the decode steps after the first are launched before the
    previous step's ids are read back."""
    from ridge import LLM
    from ridge.bench.latency import run_latency

    llm = LLM(tiny, device="cpu", show_progress=False, kv_cache_memory=4_000_000, attention_backend="triton")
    # a 2-token prompt: each prompt token is a Triton-interpreter launch per layer, and only decode overlaps
    r = run_latency(llm, 1, 2, 4, num_iters=1, warmup_iters=1, progress=False)
    assert 0 < r["overlap_fraction"] <= 1 and r["static_decode_steps"] >= 3
    assert r["overlap_fraction"] == r["overlapped_decode_steps"] / r["static_decode_steps"]


def test_latency_restores_runner_and_draws_fresh_prompts(tiny):
    from ridge import LLM
    from ridge.bench.latency import run_latency

    llm = LLM(tiny, device="cpu", show_progress=False, kv_cache_memory=4_000_000)
    seen = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda prompt, params=None, request_id=None: seen.append(prompt) or add(prompt, params)
    r = run_latency(llm, 2, 8, 2, num_iters=2, warmup_iters=1, progress=False)
    assert "execute" not in vars(llm.engine.runner) and "sample" not in vars(llm.engine.runner)
    assert llm.engine.runner.step_observers == []
    assert r["output_tokens_per_iter"] == [4, 4] and r["mbu"] is not None and r["mfu"] is None
    assert len(seen) == 6 and len({tuple(p) for p in seen}) == 6        # fresh ids every request
    assert all(len(p) == 8 and min(p) > 2 for p in seen)               # 0-2 are BOS/EOS/PAD here
    assert not llm.engine.has_unfinished()


# -- throughput ------------------------------------------------------------------------------------------
def test_runner_timer_on_cuda_pairs_events_per_step_and_never_synchronises(monkeypatch):
    """The CUDA side of RunnerTimer with a fake clock on the stream: one (start, end) event pair
    per step, a step that samples nothing joined to the next, no synchronise until device_s. The
    timer is one of the runner's step observers, the runner itself left as it is."""
    import types

    import torch

    from ridge.bench import common
    from ridge.runner.model_runner import ModelRunner

    clock = {"t": 0.0, "syncs": 0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["t"]

        def elapsed_time(self, end):        # milliseconds, as torch.cuda.Event
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(common, "sync", lambda device: clock.__setitem__("syncs", clock["syncs"] + 1))

    class FakeRunner:
        step_observers: list = []
        _observed = ModelRunner._observed
        execute, sample = ModelRunner.execute, ModelRunner.sample

        def _execute(self, sched, previous=None):
            clock["t"] += 0.002          # the step's forward on the stream
            return "logits"

        def _sample(self, logits, seqs, eos_ids):
            clock["t"] += 0.001
            return "ids"

    runner = FakeRunner()
    runner.step_observers = []
    engine = types.SimpleNamespace(runner=runner, cfg=types.SimpleNamespace(device=torch.device("cuda")))
    timer = common.RunnerTimer(engine)
    with timer:
        runner.execute(None), runner.sample("logits", [], [])          # step 1: 3 ms
        clock["t"] += 0.010                                            # idle between steps: not busy
        runner.execute(None)                                           # a chunk that samples nothing...
        runner.execute(None), runner.sample("logits", [], [])          # ...joins this step: 5 ms
    assert runner.step_observers == []                                 # unregistered
    assert len(timer.events) == 2 and clock["syncs"] == 0
    assert timer.device_s == pytest.approx(0.008) and clock["syncs"] == 1
    assert timer.device_s == pytest.approx(0.008) and clock["syncs"] == 1   # read once
    assert timer.execute_calls == 3 and timer.sample_calls == 2


def test_throughput_synthetic_json(tiny, tmp_path, capsys):
    path = tmp_path / "tp.json"
    rc, out, err = run_cli(["bench", "throughput", "--model", tiny, "--device", "cpu", "--num-prompts", "6",
                            "--input-len-range", "4", "12", "--output-len-range", "2", "6", "--ignore-eos",
                            "--temperature", "0.8", "--warmup-prompts", "2", "--no-progress",
                            "--json", str(path)] + SMALL_KV, capsys)
    assert rc == 0, err
    r = json.loads(path.read_text())
    assert r["num_requests"] == 6 and r["dataset"]["kind"] == "random"
    assert 6 * 4 <= r["prompt_tokens"] <= 6 * 12
    assert 6 * 2 <= r["requested_output_tokens"] <= 6 * 6
    assert r["output_tokens"] == r["requested_output_tokens"]            # ignore_eos: exactly as asked
    assert r["prompt_tokens_computed"] == r["prompt_tokens"]               # no prefix-cache hit on random ids
    el = r["elapsed_s"]
    assert r["requests_per_s"] == pytest.approx(6 / el)
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / el)
    assert r["total_tokens_per_s"] == pytest.approx((r["output_tokens"] + r["prompt_tokens"]) / el)
    assert 0 < r["device_busy_fraction"] <= 1 and 0 <= r["host_fraction"] < 1
    assert r["device_busy_fraction"] + r["host_fraction"] + r["outside_engine_fraction"] == pytest.approx(1)
    assert r["steps"] >= 6 and r["ttft_s"]["n"] == 6
    split = r["time_split_s"]
    assert split["device"] == pytest.approx(split["execute"] + split["sample"])         # CPU: inside the calls
    assert r["inside_runner_calls_fraction"] == pytest.approx(r["device_busy_fraction"])
    assert 0 <= split["between_execute_and_sample"] < split["engine_host"] + 1e-9 + split["device"]
    assert "output tokens/s" in out and "device (execute + sample)" in out
    assert 0 <= r["overlap_fraction"] <= 1 and "overlapped decode steps" in out


def test_throughput_fixed_lengths_and_seed(tiny, tmp_path, capsys):
    """--input-len/--output-len fix every request's lengths; the same seed draws the same prompts."""
    from ridge.bench.throughput import build_requests
    from ridge.cli import build_parser
    from ridge.config import ModelConfig

    a = build_parser().parse_args(["bench", "throughput", "--model", tiny, "--num-prompts", "5",
                                   "--input-len", "7", "--output-len", "3"])
    cfg = ModelConfig.from_dir(tiny)
    reqs, info = build_requests(a, cfg, None, 1024)
    again, _ = build_requests(a, cfg, None, 1024)
    assert [(r.input_len, r.output_len) for r in reqs] == [(7, 3)] * 5
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 5
    assert info == dict(kind="random", input_len_range=[7, 7], output_len_range=[3, 3])


# -- ShareGPT ------------------------------------------------------------------------------------------
def sharegpt_entries():
    long_text = "def fib(n): return n " * 200
    return [
        {"conversations": [{"from": "human", "value": "def fib(n):"}, {"from": "gpt", "value": "    return n"}]},
        {"id": "no conversations"},
        "not a dict",
        {"conversations": [{"from": "human", "value": "hello"}]},                       # no reply
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "import os"},
                           {"from": "gpt", "value": "class Point:"}]},                   # reply after the human turn
        {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},  # empty prompt
        {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]},   # not text
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": "ok"}]},
    ]


def test_sharegpt_loader_counts_and_lengths(tiny, tmp_path):
    from ridge.bench.datasets import load_sharegpt
    from ridge.engine.llm import load_tokenizer

    tok = load_tokenizer(tiny)
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(sharegpt_entries()))
    load = load_sharegpt(str(path), tok, max_model_len=256)
    assert (load.entries, load.skipped_malformed, load.skipped_too_long, load.scanned) == (8, 5, 1, 8)
    got = sorted((r.prompt_token_ids, r.output_len) for r in load.requests)
    want = sorted((tok(p)["input_ids"], len(tok(g, add_special_tokens=False)["input_ids"]))
                  for p, g in (("def fib(n):", "    return n"), ("import os", "class Point:")))
    assert got == want
    assert len(load_sharegpt(str(path), tok, 256, num_prompts=1).requests) == 1
    fixed = load_sharegpt(str(path), tok, 256, output_len=5)
    assert [r.output_len for r in fixed.requests] == [5, 5]


def test_sharegpt_loader_errors(tiny, tmp_path):
    from ridge.bench.datasets import load_sharegpt
    from ridge.engine.llm import load_tokenizer

    tok = load_tokenizer(tiny)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(sharegpt_entries()[1:4]))
    with pytest.raises(ValueError, match=r"no usable conversation .*3 entries: 3 malformed"):
        load_sharegpt(str(bad), tok, 256)
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(str(bad), tok, 256)
    bad.write_text("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sharegpt(str(bad), tok, 256)
    with pytest.raises(ValueError, match="no such file"):
        load_sharegpt(str(tmp_path / "missing.json"), tok, 256)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_sharegpt(str(bad), None, 256)


def test_throughput_sharegpt_cli(tiny, tmp_path):
    """Through the installed command line, in a subprocess: the dataset path end to end."""
    data, out = tmp_path / "sg.json", tmp_path / "tp.json"
    data.write_text(json.dumps(sharegpt_entries()))
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "bench", "throughput", "--model", tiny, "--device", "cpu",
                        "--dataset", str(data), "--max-model-len", "256", "--ignore-eos", "--warmup-prompts", "0",
                        "--json", str(out)] + SMALL_KV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["dataset"]["kind"] == "sharegpt"
    assert (res["dataset"]["skipped_malformed"], res["dataset"]["skipped_too_long"], res["num_requests"]) == (5, 1, 2)
    assert res["output_tokens"] == res["requested_output_tokens"] > 0
    assert "ShareGPT" in r.stdout and "5 malformed" in r.stdout


# -- bad options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["latency", "--input-len", "1000", "--output-len", "100"], "exceeds max_model_len=1024"),
    (["latency", "--input-len", "60", "--output-len", "8", "--max-model-len", "64"], "exceeds max_model_len=64"),
    (["latency", "--max-model-len", "4096"], "max_model_len: must be in [2, 1024]"),
    (["latency", "--batch-size", "3", "--max-num-seqs", "2"], "raise --max-num-seqs"),
    (["latency", "--output-len", "0"], "output-len: must be >= 1"),
    (["latency", "--num-iters", "0"], "num-iters: must be >= 1"),
    (["throughput", "--input-len-range", "9", "3"], "input-len-range: LO (9) is greater than HI (3)"),
    (["throughput", "--output-len-range", "0", "3"], "output-len-range: lengths must be >= 1"),
    (["throughput", "--input-len-range", "500", "600", "--output-len", "500"], "exceeds max_model_len=1024"),
    (["throughput", "--num-prompts", "0"], "num-prompts: must be >= 1"),
    (["throughput", "--dataset", "/nonexistent/sg.json"], "dataset: no such file"),
    (["throughput", "--dataset", "x.json", "--input-len", "8"], "lengths come from the file"),
])
def test_bad_options_rejected(tiny, capsys, args, message):
    rc, out, err = run_cli(["bench", args[0], "--model", tiny, "--device", "cpu"] + args[1:], capsys)
    assert rc == 2
    assert message in err and err.startswith("ridge: error: ")


def test_conflicting_length_options_are_a_usage_error(tiny, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--model", tiny, "--input-len", "8", "--input-len-range", "4", "12"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# -- benchmarks/engine/fast_path.py ------------------------------------------------------------------------
def test_fast_path_smoke(tiny, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("fast_path", os.path.join(ROOT, "benchmarks", "engine", "fast_path.py"))
    fast_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fast_path)
    path = tmp_path / "fp.json"
    rc = fast_path.main(["--model", tiny, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "4e6",
                         "--latency-input-len", "8", "--latency-output-len", "4", "--latency-iters", "2",
                         "--latency-warmup", "1", "--throughput-num-prompts", "3", "--throughput-input-len", "8",
                         "--throughput-output-len", "4", "--workload-num-prompts", "4",
                         "--workload-len-range", "3", "9", "--hf-iters", "3", "--json", str(path)])
    assert rc == 0
    r = json.loads(path.read_text())
    m = r["models"][tiny]
    lat, tp, wl = m["latency"], m["throughput"], m["workload"]["ridge"]
    assert lat["ridge"]["output_tokens_per_iter"] == [4, 4]
    assert lat["hf"]["attn_implementation"] == "sdpa" and lat["hf"]["output_len"] == 4
    assert lat["ratio_e2e"] == pytest.approx(lat["ridge"]["output_tokens_per_s"] / lat["hf"]["output_tokens_per_s"])
    # HF's decode rate is (n - 1) / (t(n tokens) - t(1 token)): None when a loaded CPU makes that
    # difference non-positive, and then so is the ratio
    assert (lat["ratio_decode"] is None) == (lat["hf"]["decode_tokens_per_s"] is None)
    assert (lat["ratio_decode"] or 1) > 0 and lat["ridge"]["mbu"] > 0
    assert tp["ridge"]["output_tokens"] == 3 * 4 and tp["hf"]["output_tokens"] == 3 * 4
    assert tp["ratio"] == pytest.approx(tp["ridge"]["output_tokens_per_s"] / tp["hf"]["output_tokens_per_s"])
    assert wl["num_requests"] == 4 and wl["output_tokens"] == wl["requested_output_tokens"]
    assert wl["config"]["temperature"] == 0.6 and wl["config"]["ignore_eos"] is True
    assert 0 < wl["device_busy_fraction"] <= 1
    out = capsys.readouterr().out
    table = out[out.rindex("fast path:"):]                    # the table comes last
    for label in ("(a) b=1 8->4 e2e tok/s", "(b) 3x 8->4 output tok/s", "(c) 4 req [3,9] output tok/s"):
        assert label in table


def test_fast_path_rejects_unknown_part(tiny, capsys):
    spec = importlib.util.spec_from_file_location("fast_path", os.path.join(ROOT, "benchmarks", "engine", "fast_path.py"))
    fast_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fast_path)
    with pytest.raises(SystemExit):
        fast_path.main(["--model", tiny, "--only", "latency,decode"])
    assert "unknown part" in capsys.readouterr().err


def test_speculation_report_between_snapshots():
    """`ridge bench`'s speculation figures are the difference of two engine snapshots: per-position
    acceptance over the verify steps between them, the proposer's time a draft token; and the table
    rows name the proposer."""
    from ridge.bench.common import speculation, speculation_rows
    from ridge.engine.engine import EngineStats
    base = (1, 0, 10, 5, 0.5, 0, 3, 4, 0, 0)
    before = EngineStats(*base, spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=3,
                         spec_accepted_per_pos=(2, 1), spec_propose_seconds=0.5, spec_method="suffix")
    after = EngineStats(*base, spec_num_drafts=6, spec_num_draft_tokens=24, spec_num_accepted_tokens=9,
                        spec_accepted_per_pos=(5, 3, 1), spec_propose_seconds=0.5 + 16e-6 * 40, spec_method="suffix")
    r = speculation(before, after)
    assert r["spec_method"] == "suffix" and r["spec_num_drafts"] == 4 and r["spec_num_accepted_tokens"] == 6
    assert r["spec_acceptance_per_pos"] == [3 / 4, 2 / 4, 1 / 4]
    assert r["spec_propose_us_per_draft_token"] == pytest.approx(40.0)
    rows = dict(speculation_rows(r))
    assert rows["spec proposer"] == "suffix" and rows["spec acceptance by position"] == "75% 50% 25%"
    assert "40.0 us a draft token" in rows["spec draft cost"]
    assert speculation_rows(speculation(after, after)) == []        # nothing drafted between them
