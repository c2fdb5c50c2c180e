"""The benchmark scripts on the CPU: every benchmarks/*.py imports and answers --help; the timing
helper's median / rotation logic on a fake clock; the A/B's bookkeeping; gpu_run.sh and
make_baseline.sh are valid bash and gpu_run.sh names only parts it implements."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.tests_support import REPO as ROOT
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPTS = sorted(glob.glob(os.path.join(BENCH, "*.py")))
LIBRARIES = ("timing.py", "case_study_serve.py", "case_study_story.py", "tp_scale.py")          # imported by the scripts, not run


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(p) for p in SCRIPTS])
def test_script_imports_and_answers_help(path):
    load(os.path.basename(path)[:-3])
    if os.path.basename(path) in LIBRARIES:
        return
    p = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, env=env(), cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage:" in p.stdout


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
        src = open(os.path.join(BENCH, f"{name}.py")).read()
        assert "from timing import" in src
        for other in ("do_bench", "CUDAGraph", "elapsed_time", "pdl", "SMALL_BATCH_GEMV", "write_kv", "apply_rotary",
                      "switched_on", "ridge.layers.norm", "ridge.layers.activation"):
            assert not re.search(rf"\b{other}\b", src), (name, other)
        assert '"rms_norm"' not in src


# -------------------------------------------------------------------------------------------- A/B
def fast_path_result(decode, mbu, tput, work, overlap=None):
    lat = {"decode_tokens_per_s": decode, "mbu": mbu, "env": {"commit": "abc"}}
    if overlap is not None:
        lat["steps"] = {"overlap_fraction": overlap}
    return {"models": {"/m": {"latency": {"ridge": lat}, "throughput": {"ridge": {"output_tokens_per_s": tput}},
                              "workload": {"ridge": {"output_tokens_per_s": work}}}}}


def test_ab_extracts_and_summarizes(monkeypatch):
    ab = load("ab")
    monkeypatch.delenv("OUT", raising=False)
    a = ab.parse_args([])
    assert a.variants == list(ab.VARIANTS) and a.parts == list(ab.PARTS) and a.variant_parts == ["latency"]
    v = ab.extract(fast_path_result(200.0, 0.8, 5000.0, 7000.0, overlap=0.9))
    assert v["latency.decode_tokens_per_s"] == 200.0 and v["latency.overlap_fraction"] == 0.9
    assert ab.extract(fast_path_result(1, 1, 1, 1))["latency.overlap_fraction"] is None
    assert set(ab.extract(fast_path_result(1, 1, 1, 1), ["latency"])) == {
        "latency.decode_tokens_per_s", "latency.mbu", "latency.overlap_fraction", "latency.commit"}
    runs = [{"variant": "base", "values": ab.extract(fast_path_result(d, 0.8, 5000, 7000))} for d in (200, 220, 210)]
    runs += [{"variant": "this", "values": ab.extract(fast_path_result(d, 0.8, 5500, 7000))} for d in (231, 189)]
    runs += [{"variant": "base+pdl", "rc": 1}]
    s = ab.summarize(runs, ["this", "base", "base+pdl"])
    assert s["base"]["latency.decode_tokens_per_s"]["median"] == 210
    assert s["base"]["latency.decode_tokens_per_s"]["spread"] == pytest.approx(20 / 210)
    assert s["this"]["latency.decode_tokens_per_s"]["ratio_to_base"] == pytest.approx(210 / 210)
    assert s["this"]["throughput.output_tokens_per_s"]["ratio_to_base"] == pytest.approx(1.1)
    assert s["base+pdl"] == {}
    for bad in (["--parts", "nope"], ["--repeats", "0"], ["--variants", "pdl"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


def test_ab_runs_each_tree_with_its_own_path_and_switches(monkeypatch):
    ab = load("ab")
    monkeypatch.setenv("RIDGE_PDL", "1")
    a = ab.parse_args(["--baseline", "/b", "--fast-path-args", "--dtype float32"])
    assert ab.tree_of(a, "this") == ROOT and ab.tree_of(a, "base+pdl") == "/b"
    e = ab.run_env("/b", {}, "/c")
    assert e["PYTHONPATH"] == "/b" and e["RIDGE_CACHE_DIR"] == "/c"
    assert "RIDGE_PDL" not in e and "RIDGE_FUSE_NORM" not in e
    assert ab.run_env("/b", ab.VARIANTS["base+pdl+fuse_norm"][1], "/c")["RIDGE_FUSE_NORM"] == "1"
    cmd = ab.fast_path_cmd(a, "/b", ["latency"], "/tmp/x.json")
    assert cmd[1] == "/b/benchmarks/fast_path.py" and cmd[-2:] == ["--dtype", "float32"]
    # a latency-only run also runs a one-request workload: its engine is sized as the full runs'
    assert "--no-hf" in cmd and cmd[cmd.index("--only") + 1] == "latency,workload"
    assert cmd[cmd.index("--workload-len-range") + 1:][:2] == ["1024", "1024"]
    full = ab.fast_path_cmd(a, "/b", list(ab.PARTS), "/tmp/x.json")
    assert full[full.index("--only") + 1] == "latency,throughput,workload" and "--workload-num-prompts" not in full


def test_engine_ready_arguments(monkeypatch):
    er = load("engine_ready")
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    a = er.parse_args([])
    assert a.json == "/tmp/somewhere/engine_ready.json" and a.runs == 2 and a.target_s == 15.0
    with pytest.raises(SystemExit):
        er.parse_args(["--runs", "0"])


# ------------------------------------------------------------------------------------ shell scripts
def test_gpu_run_is_valid_and_names_only_parts_it_implements(tmp_path):
    path = os.path.join(BENCH, "gpu_run.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    src = open(path).read()
    known = re.search(r"^KNOWN=(\S+)$", src, re.M).group(1).split(",")
    implemented = re.findall(r"^\s*part ([a-z0-9-]+) \d+ \d+ ", src, re.M)
    assert sorted(known) == sorted(implemented)
    documented = re.findall(r"^#   ([a-z0-9-]+)\s{2,}", src, re.M)
    assert sorted(documented) == sorted(known)
    default = re.search(r"^PARTS=\$\{PARTS:-(\S+)\}$", src, re.M).group(1).split(",")
    assert default == ["tests-kernels", "ab", "dummy", "tests-engine"] and set(default) <= set(known)
    order = [known.index(p) for p in default]
    assert order == sorted(order)
    assert glob.glob(os.path.join(BENCH, "gpu_*.sh")) == [path]
    p = subprocess.run(["bash", path], env=dict(os.environ, PARTS="tests-kernels,bogus", OUT=str(tmp_path)),
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and "unknown part 'bogus'" in p.stderr


def test_make_baseline_is_valid_bash():
    path = os.path.join(BENCH, "make_baseline.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    src = open(path).read()
    assert "5e4f924" in src and "git archive" in src
    assert "/.baseline/" in open(os.path.join(ROOT, ".gitignore")).read().split()


def test_kernel_sass_reads_a_kernel_loop_without_a_gpu(tmp_path):
    """benchmarks/kernel_sass.py compiles for sm_90a on this CPU (compiled kernels: not under the
    interpreter, so in a process of its own): the bf16 small gate/up kernel's loop is found, does
    one FMA a weight at least, and spills nothing; with --int4-gemv the dense INT4 GEMV's loop at
    int4_matmul's config is read too: its tensor-core MMAs, no spill."""
    import json
    out = tmp_path / "ks.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_sass.py"), "--kernels", "small gate/up",
                    "--formats", "bf16", "--int4-gemv", "--json", str(out)], check=True, env=env, capture_output=True,
                   timeout=600)
    row, gemv = json.loads(out.read_text())["rows"]
    assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 255
    assert row["loop"].get("FFMA", 0) >= row["weights_per_thread"] > 0
    assert gemv["kernel"].startswith("dense gemv") and gemv["spill_bytes"] == 0 and gemv["loop"].get("HMMA", 0) > 0
