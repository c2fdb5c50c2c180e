"""benchmarks/case_study/case_study_70b.py (issue 21) end to end on the CPU: `round --round 0 --smoke` runs the
whole pipeline (one engine for ridge bench latency + ridge roofline, then ridge serve + ridge bench
serve) on a bundled demo model at tiny lengths and writes summary.json with every figure, its
target and the roofline's prediction beside the measurement; `story` fills the doc's figures table
from it and leaves the rounds without a summary as not yet measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tests_support import REPO as ROOT

# the module fixture round0 (a whole smoke round in a subprocess) costs more than the tests: under
# pytest-xdist they run on one worker, so it is built once
pytestmark = pytest.mark.xdist_group("case_study")
SCRIPT = os.path.join(ROOT, "benchmarks", "case_study", "case_study_70b.py")


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout


def run_here(*args) -> None:
    """The script's command in this process (its main(argv)): for the commands that start no engine
    or server (story, round --summarize-only), a fresh interpreter would be most of their cost."""
    from tests.tests_support import load_benchmark
    assert load_benchmark("case_study_70b").main(list(args)) == 0


@pytest.fixture(scope="module")
def round0(tmp_path_factory):
    out = tmp_path_factory.mktemp("cs") / "case-study-70b" / "round-0"
    run("round", "--round", "0", "--smoke", "--out", str(out))
    return out


@pytest.mark.slow
def test_smoke_round_writes_every_figure_with_its_prediction(round0):
    for name in ("summary.json", "report.md", "report.json", "roofline.png", "latency_b1.json", "latency_b4.json",
                 "serve_sweep.json"):
        assert (round0 / name).is_file(), name
    s = json.loads((round0 / "summary.json").read_text())
    assert s["round"] == 0 and s["smoke"] and s["measure_rc"] == 0
    assert s["flags"][:2] == ["--quantization", "fp8"]
    figs = {f["name"]: f for f in s["figures"]}
    assert set(figs) == {"ttft_b1_ms", "itl_b1_ms", "step_b64_ms", "decode_b64_tok_s", "goodput_tok_s"}
    for name in ("ttft_b1_ms", "itl_b1_ms", "step_b64_ms", "decode_b64_tok_s"):
        f = figs[name]
        assert isinstance(f["measured"], float) and f["measured"] > 0, f
        assert isinstance(f["predicted"], float) and f["predicted"] > 0, f
        assert f["prediction_gap"] == pytest.approx((f["measured"] - f["predicted"]) / f["measured"])
        assert f["prediction_flag"] in ("within 15%", "off by more than 15%: explain")
    for name, target in (("ttft_b1_ms", 300.0), ("itl_b1_ms", 12.0), ("goodput_tok_s", 2500.0)):
        f = figs[name]
        assert f["target"] == target
        assert f["met"] is None if f["measured"] is None else f["met"] == (
            f["measured"] <= target if f["comparison"] == "<=" else f["measured"] >= target)
    sweep = json.loads((round0 / "serve_sweep.json").read_text())
    probes = [p for p in sweep["probes"] if "skipped" not in p]
    assert probes and all(p.get("error") is None for p in probes), sweep
    for p in probes:             # each probe is a ridge bench serve run of its own, p99s from its JSON
        r = json.loads((round0 / f"serve_rate{p['rate']:g}.json").read_text())["summary"]
        assert p["ttft_p99_s"] == r["ttft_s"]["p99"] and p["goodput_tok_s"] == r["goodput_output_throughput"]
    assert (figs["goodput_tok_s"]["measured"] is None) == (sweep["chosen_rate"] is None)
    # the server's chunk is sized from the round's batch-1 run (decode step + chunk under 80% of the SLO)
    b1 = json.loads((round0 / "latency_b1.json").read_text())
    per_token, step = b1["ttft_s"]["median"] / 16, 1 / b1["decode_tokens_per_s"]
    budget = sweep["max_num_batched_tokens"]
    chunk = min(128, max(32, int((0.04 - step) / per_token) // 16 * 16))
    idle_ttft = -(-16 // chunk) * (step + chunk * per_token)     # unless that breaks TTFT: whole prompts
    assert budget == (chunk if idle_ttft < 0.4 else 128) and "prefill tokens" in sweep["budget_from"]
    assert ("no chunk keeps both" in sweep["budget_from"]) == (idle_ttft >= 0.4)
    assert s["serve"]["max_num_batched_tokens"] == budget
    assert s["roofline_first_target"] and all(v.startswith("attack") for v in s["roofline_first_target"].values())


def test_story_fills_the_table_from_the_summaries(round0):
    rounds = round0.parent
    doc = rounds.parent / "case-study-70b.md"
    run_here("story", "--rounds", str(rounds))
    text = doc.read_text()
    assert "<!-- figures:begin" in text and "## Round 3" in text and (rounds / "rounds.png").is_file()
    row = next(line for line in text.splitlines() if line.startswith("| TTFT, batch 1"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    measured = json.loads((round0 / "summary.json").read_text())["figures"][0]["measured"]
    assert cells[1] == "<= 300" and cells[2].startswith(f"{measured:,.4g}")
    assert cells[3:] == ["not yet measured"] * 3
    # the prose around the table is kept when the table is written again
    doc.write_text(text.replace("(not yet written)", "the lead's prose", 1))
    run_here("story", "--rounds", str(rounds))
    assert "the lead's prose" in doc.read_text() and doc.read_text().count("<!-- figures:begin") == 1


def test_a_server_that_does_not_start_keeps_the_measured_round(round0, tmp_path, monkeypatch):
    """The serve sweep's server dies at start (a missing package on the device, say): the round's
    summary still carries what the measure part wrote, and the sweep says why it has no goodput.
    `--summarize-only` then rewrites the summary from the files alone, measuring nothing."""
    import shutil
    from types import SimpleNamespace

    from tests.tests_support import load_benchmark
    cs = load_benchmark("case_study_70b")
    out = tmp_path / "round-0"
    shutil.copytree(round0, out)
    (out / "summary.json").unlink()

    def no_server(*args, **kwargs):
        raise RuntimeError("ridge serve did not start: ModuleNotFoundError: No module named 'opentelemetry'")
    monkeypatch.setattr(cs.serve_part, "start_server", no_server)
    monkeypatch.setattr(cs, "subprocess", SimpleNamespace(run=lambda *a, **k: SimpleNamespace(returncode=0)))  # measure
    args = cs.argparse.Namespace(round=0, smoke=True, model=None, out=str(out), engine_args="", budget_s=60,
                                 rates=None, num_prompts=None, start_timeout_s=1, no_serve=False, summarize_only=False,
                                 serve_only=False)
    assert cs.run_round(args) == 0
    s = json.loads((out / "summary.json").read_text())
    figs = {f["name"]: f for f in s["figures"]}
    assert figs["itl_b1_ms"]["measured"] > 0 and figs["goodput_tok_s"]["measured"] is None
    assert "opentelemetry" in s["serve"]["note"] and s["serve"]["probes"] == []
    before = figs
    (out / "summary.json").unlink()
    run_here("round", "--round", "0", "--smoke", "--summarize-only", "--out", str(out))
    s = json.loads((out / "summary.json").read_text())
    assert s["measure_s"] is None and "opentelemetry" in s["serve"]["note"]
    assert {f["name"]: f["measured"] for f in s["figures"]} == {n: f["measured"] for n, f in before.items()}


@pytest.mark.slow
def test_serve_only_adds_the_sweep_to_a_measured_round(round0, tmp_path):
    """`--serve-only`: the serve sweep of a round measured earlier (its server's chunk sized from the
    round's own batch-1 run), the measured files untouched, the summary carrying both."""
    import shutil
    out = tmp_path / "round-0"
    shutil.copytree(round0, out)
    for f in out.glob("serve*"):
        f.unlink()
    kept = {f.name: f.read_bytes() for f in out.glob("latency_*.json")} | {"report.json": (out / "report.json").read_bytes()}
    run("round", "--round", "0", "--smoke", "--serve-only", "--out", str(out))
    assert {n: (out / n).read_bytes() for n in kept} == kept
    sweep = json.loads((out / "serve_sweep.json").read_text())
    assert sweep["device"] and [p for p in sweep["probes"] if "skipped" not in p and p.get("error") is None], sweep
    s = json.loads((out / "summary.json").read_text())
    measured = json.loads((round0 / "summary.json").read_text())      # what --serve-only did not run keeps its figure
    assert s["measure_s"] == measured["measure_s"] > 0 and s["measure_rc"] == 0
    assert s["serve"]["max_num_batched_tokens"] == sweep["max_num_batched_tokens"]
    figs = {f["name"]: f["measured"] for f in s["figures"]}
    assert figs["goodput_tok_s"] == sweep["goodput_tok_s"] and figs["itl_b1_ms"] > 0


def test_story_names_the_serve_sweeps_card_and_survives_a_round_without_one(round0, tmp_path):
    import shutil
    rounds = tmp_path / "case-study-70b"
    shutil.copytree(round0, rounds / "round-0")
    s = json.loads((rounds / "round-0" / "summary.json").read_text())
    s["device"], s["serve"]["device"] = None, "NVIDIA H100 80GB HBM3"   # a failed measure; the sweep ran later
    (rounds / "round-0" / "summary.json").write_text(json.dumps(s))
    run_here("story", "--rounds", str(rounds))
    line = next(x for x in (tmp_path / "case-study-70b.md").read_text().splitlines() if x.startswith("Rounds measured"))
    assert "0 (device unknown; serve sweep on NVIDIA H100 80GB HBM3" in line
