"""The benchmark scripts on the CPU: every benchmarks/<folder>/*.py imports and answers --help; the
timing helper's median / rotation logic on a fake clock, on ridge's one timer; the A/B's
bookkeeping; the runner (benchmarks/run.py) names every part once, each part's commands name scripts
that exist, and it skips, times out and reports parts as it says."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import runpy
import subprocess
import sys

import pytest

from tests.tests_support import REPO as ROOT
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPTS = sorted(p for p in glob.glob(os.path.join(BENCH, "*.py")) + glob.glob(os.path.join(BENCH, "*", "*.py"))
                 if os.path.basename(p) != "__init__.py")
LIBRARIES = ("timing.py", "case_study_serve.py", "case_study_story.py", "tp_scale.py", "spec_demo.py")          # imported by the scripts, not run


def load(name: str):
    """benchmarks/<name>.py (name: "timing", "engine/engine_ready", ...) as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{os.path.basename(name)}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.relpath(p, BENCH) for p in SCRIPTS])
def test_script_imports_and_answers_help(path, monkeypatch, capsys):
    load(os.path.relpath(path, BENCH)[:-3])
    if os.path.basename(path) in LIBRARIES:
        return
    # `PYTHONPATH=ROOT python PATH --help` from the repo root, run in this process as __main__: a fresh
    # interpreter per script is seconds of importing torch, and every script parses its arguments
    # before it does anything else
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.syspath_prepend(os.path.dirname(path))       # what python puts first for a script
    monkeypatch.chdir(ROOT)
    try:
        runpy.run_path(path, run_name="__main__")
        returncode = 0
    except SystemExit as e:                     # the exit status a process would have had
        returncode = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    assert returncode == 0, out.err[-2000:]
    assert "usage:" in out.out


# ---------------------------------------------------------------------------------------- timing
class FakeReplayer:
    """Runs the calls once at prepare (as the warm-up before capture does) and returns scripted
    replay times."""

    def __init__(self, times_ms):
        self.times = list(times_ms)
        self.prepared = []

    def prepare(self, fns, graph):
        self.graph = graph
        for f in fns:
            f()
        self.prepared = list(fns)
        return lambda: None

    def time_ms(self, run):
        return self.times.pop(0)


def test_copies_exceed_twice_l2_and_calls_are_multiples():
    t = load("timing")
    l2 = 50 << 20
    for nbytes in (1, 4096, 24 << 10, 10 << 20, 33 << 20, 100 << 20, 1 << 30):
        n = t.copies_for(nbytes, l2)
        assert n * nbytes > 2 * l2 and (n - 1) * nbytes <= 2 * l2
        for min_calls in (1, 5, 20, 64):
            c = t.calls_for(n, min_calls)
            assert c >= min_calls and c % n == 0 and c - n < max(min_calls, n)
    with pytest.raises(ValueError):
        t.copies_for(0, l2)


def test_median_per_call_after_warmup():
    t = load("timing")
    calls = [0]
    fns = [lambda: calls.__setitem__(0, calls[0] + 1)] * 4
    # 2 warm-up replays (huge, must be ignored), then 5 timed: per call = ms * 1000 / 4 us
    rp = FakeReplayer([1000.0, 900.0, 4.0, 8.0, 2.0, 6.0, 400.0])
    r = t.time_calls(fns, sets=2, reps=5, warmup=2, replayer=rp)
    assert calls[0] == 4 and not rp.times
    assert r.median_us == pytest.approx(6.0 * 1e3 / 4) and r.min_us == pytest.approx(500.0)
    assert r.max_us == pytest.approx(1e5) and r.reps == 5 and r.calls == 4 and r.sets == 2 and r.mode == "graph"
    assert r.spread == pytest.approx((1e5 - 500.0) / 1500.0)
    assert r.as_dict()["spread"] == r.spread
    with pytest.raises(ValueError):
        t.time_calls([], replayer=FakeReplayer([]))


def test_rotation_visits_every_set_equally_in_order():
    t = load("timing")
    seen = []
    sets = ["a", "b", "c"]
    rp = FakeReplayer([1.0] * 4)
    r = t.time_rotating(seen.append, sets, min_calls=5, reps=3, warmup=1, graph=False, replayer=rp)
    assert seen == ["a", "b", "c"] * 2 and r.calls == 6 and r.sets == 3 and r.mode == "eager"
    assert r.median_us == pytest.approx(1e3 / 6)


def test_rotating_sets_draws_fresh_sets_over_twice_l2():
    t = load("timing")
    made = []

    def make():
        made.append(object())
        return made[-1]
    sets = t.rotating_sets(make, 1 << 20, l2=8 << 20)
    assert len(sets) == 17 and len(set(map(id, sets))) == 17
    with pytest.raises(ValueError):
        t.rotating_sets(make, 1, l2=8 << 20, max_sets=100)


def test_kernel_benchmarks_use_the_one_timer():
    for name in ("attention", "gemv", "fused_kernels", "fp8_producers"):
        src = open(os.path.join(BENCH, "kernels", f"{name}.py")).read()
        assert "from benchmarks.timing import" in src
        for other in ("do_bench", "CUDAGraph", "elapsed_time", "pdl", "SMALL_BATCH_GEMV", "write_kv", "apply_rotary",
                      "switched_on", "ridge.layers.norm", "ridge.layers.activation"):
            assert not re.search(rf"\b{other}\b", src), (name, other)
        assert '"rms_norm"' not in src
    # and the benchmarks' timer is ridge's own (the one the GEMM dispatches choose with), not a copy
    src = open(os.path.join(BENCH, "timing.py")).read()
    assert "ridge.utils.graph_timing" in src
    for other in ("CUDAGraph", "elapsed_time", "Event", "torch.cuda.graph", "torch.cuda.Stream"):
        assert other not in src, other


# -------------------------------------------------------------------------------------------- A/B
def test_ab_runs_each_tree_in_its_own_path_and_cache(tmp_path):
    ab = load("engine/ab_decode")
    a = ab.parse_args(["--baseline", "/b", "--log-dir", str(tmp_path)])
    assert a.cases == [("bf16", 1), ("int4", 1), ("fp8", 1), ("bf16", 64)] and a.repeats == 1
    assert ab.tree_dir(a, "this") == ROOT and ab.tree_dir(a, "base") == "/b"
    e = ab.run_env("/b", "/c")
    assert e["PYTHONPATH"] == "/b" and e["RIDGE_CACHE_DIR"] == "/c"
    cmd = ab.latency_cmd(a, "int4", 64, "/tmp/x.json")
    assert cmd[1:5] == ["-m", "ridge", "bench", "latency"]
    assert cmd[cmd.index("--quantization") + 1] == "int4" and cmd[cmd.index("--batch-size") + 1] == "64"
    assert cmd[cmd.index("--load-format") + 1] == "dummy" and cmd[-2:] == ["--json", "/tmp/x.json"]
    assert "--quantization" not in ab.latency_cmd(a, "bf16", 1, "/tmp/x.json")
    for bad in (["--baseline", "/b", "--cases", "int8:1"], ["--baseline", "/b", "--cases", "fp8:0"],
                ["--baseline", "/b", "--repeats", "0"], []):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


def test_ab_summarizes_medians_and_ratio():
    ab = load("engine/ab_decode")
    runs = [{"tree": "base", "case": "bf16 b=1", "rc": 0, "values": {"decode_tokens_per_s": d, "mbu": 0.5}}
            for d in (200, 220, 210)]
    runs += [{"tree": "this", "case": "bf16 b=1", "rc": 0, "values": {"decode_tokens_per_s": d, "mbu": 0.6}}
             for d in (231, 189)]
    runs += [{"tree": "this", "case": "fp8 b=1", "rc": 1}]
    s = ab.summarize(runs, ["bf16 b=1", "fp8 b=1"])
    assert s["bf16 b=1"]["base"] == 210 and s["bf16 b=1"]["this"] == 210 and s["bf16 b=1"]["ratio"] == 1.0
    assert s["bf16 b=1"]["this_mbu"] == 0.6 and s["bf16 b=1"]["base_mbu"] == 0.5
    assert s["fp8 b=1"] == {"this": None, "this_mbu": None, "base": None, "base_mbu": None, "ratio": None}


def test_engine_ready_arguments(monkeypatch):
    er = load("engine/engine_ready")
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    a = er.parse_args([])
    assert a.json == "/tmp/somewhere/engine_ready.json" and a.runs == 2 and a.target_s == 15.0
    with pytest.raises(SystemExit):
        er.parse_args(["--runs", "0"])


# ------------------------------------------------------------------------------------------ runner
GPU_RUN_PARTS = ("tests-kernels,attention,gemv,fused,int4,fp8,fp8-producers,ab,dummy,tests-engine,fastpath,int4-e2e,"
                 "int4-roofline,int4-quality,fp8-attn,fp8-quality,fp8-e2e,fp8-throughput,fp8-roofline,spec-demo,spec-agent,"
                 "spec-verify,spec-oracle,structured,serve-load,moe-tests,moe-kernels,moe-e2e,moe-roofline,moe-mixtral,mla,mla-e2e,"
                 "moe-fp8,moe-int4,tp-tests,tp,tp-comm,tp-scale,tp-scale-8b,case-70b").split(",")


def fake_run(run, tmp_path, **kw):
    args = dict(out=str(tmp_path), extra=[], baseline=None, round=0, batches=None, tests=True, budget_s=560.0,
                env=dict(os.environ, PYTHONPATH=ROOT))
    args.update(kw)
    os.makedirs(tmp_path / "logs", exist_ok=True)
    return run.Run(**args)


def test_runner_keeps_every_part_and_each_command_names_a_script_that_exists(tmp_path):
    run = load("run")
    names = [p.name for p in run.PARTS]
    assert len(names) == len(set(names)) and set(GPU_RUN_PARTS) | {"tests-gpu"} == set(names)
    base = tmp_path / "base"
    (base / "ridge").mkdir(parents=True)
    r = fake_run(run, tmp_path, baseline=str(base), extra=["--x"])
    for p in run.PARTS:
        steps = p.steps(r)
        assert steps, p.name
        for c in steps:
            if isinstance(c, run.Cmd) and len(c.argv) > 1 and c.argv[1].startswith("benchmarks/"):
                assert os.path.isfile(os.path.join(ROOT, c.argv[1])), (p.name, c.argv)
        # the arguments after -- reach a command of the parts that say they take them, and only those
        assert any("--x" in c.argv for c in steps if isinstance(c, run.Cmd)) == p.extra, p.name
        for c in steps:
            if isinstance(c, run.Cmd) and c.argv[1:3] == ["-m", "pytest"]:
                assert c.argv[c.argv.index("gpu") - 1] == "-m", p.name       # the GPU tests only
    kernel_tests = run.BY_NAME["tests-kernels"].steps(r)[0].argv
    assert kernel_tests[-1] == "tests/kernels"
    assert run.BY_NAME["tests-gpu"].steps(r)[0].argv[-1] == "tests"


def test_runner_refuses_unknown_parts_and_ab_without_a_baseline(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "tests-kernels", "bogus", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and "unknown part(s) bogus" in p.stderr
    run = load("run")
    a = run.parse_args(["int4", "--out", "o", "--", "--models", "llama3-8b"])
    assert a.parts == ["int4"] and a.extra == ["--models", "llama3-8b"] and a.out == "o"
    r = fake_run(run, tmp_path)
    row = run.run_part(run.BY_NAME["ab"], r, open(os.devnull, "w"))
    assert row["status"].startswith("error") and "--export-baseline" in row["status"]


def test_runner_skips_times_out_and_reports(tmp_path):
    run = load("run")
    r = fake_run(run, tmp_path, budget_s=30.0)
    sleep = run.Part("sleep", "sleeps", lambda r: [run.py("-c", "import time; print('started', flush=True); "
                                                                 "time.sleep(60)")], 1, 0)
    big = run.Part("big", "needs more than is left", lambda r: [run.py("-c", "")], 100, 1000)
    fails = run.Part("fails", "a failing check=False step, then one that passes",
                     lambda r: [run.py("-c", "raise SystemExit(3)", check=False), run.py("-c", "print('after')")], 60, 0)
    with open(tmp_path / "run.log", "w") as log:
        rows = [run.run_part(p, r, log) for p in (sleep, big, fails)]
    assert rows[0]["status"] == "timed out" and rows[0]["seconds"] < 20
    assert "started" in open(tmp_path / "logs" / "sleep.log").read()
    assert rows[1]["status"].startswith("SKIPPED")
    assert rows[2]["status"] == "rc=3" and "after" in open(tmp_path / "logs" / "fails.log").read()
    assert "sleep" in run.table(rows) and "SKIPPED" in run.table(rows)


def test_export_baseline_writes_a_tree_without_weights(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    run = load("run")
    dest = tmp_path / "base"
    assert run.export_baseline("HEAD", str(dest)) == 0
    assert (dest / "ridge" / "__init__.py").is_file() and (dest / "COMMIT").read_text().strip()
    assert not list(dest.glob("ridge/assets/*/model.safetensors"))
    assert "/.baseline/" in open(os.path.join(ROOT, ".gitignore")).read().split()


def test_kernel_sass_reads_a_kernel_loop_without_a_gpu(tmp_path):
    """benchmarks/kernels/kernel_sass.py compiles for sm_90a on this CPU (compiled kernels: not under the
    interpreter, so in a process of its own): the bf16 small gate/up kernel's loop is found, does
    one FMA a weight at least, and spills nothing; with --int4-gemv the dense INT4 GEMV's loop at
    int4_matmul's config is read too: its tensor-core MMAs, no spill."""
    import json
    out = tmp_path / "ks.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "kernel_sass.py"),
                    "--kernels", "small gate/up",
                    "--formats", "bf16", "--int4-gemv", "--json", str(out)], check=True, env=env, capture_output=True,
                   timeout=600)
    row, gemv = json.loads(out.read_text())["rows"]
    assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 255
    assert row["loop"].get("FFMA", 0) >= row["weights_per_thread"] > 0
    assert gemv["kernel"].startswith("dense gemv") and gemv["spill_bytes"] == 0 and gemv["loop"].get("HMMA", 0) > 0
