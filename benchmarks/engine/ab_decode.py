"""A/B of this tree's decode against a baseline tree (a `git archive` export: `python3 benchmarks/run.py
--export-baseline COMMIT`), in one device run, each measurement in its own process.

    python3 benchmarks/engine/ab_decode.py --baseline .baseline/5dbd213 --json ab.json \\
        [--model /tmp/ridge-llama3-8b-config] [--cases bf16:1 int4:1 fp8:1 bf16:64] [--repeats 1]

Each run is `python3 -m ridge bench latency` of one tree (its working directory and PYTHONPATH set to
that tree, its own RIDGE_CACHE_DIR: the trees may keep their dispatch tables and ceilings in
different formats) on the same config-only checkpoint with --load-format dummy, so each side loads,
tunes and runs its own engine and kernels: prompt 128, --output-len greedy tokens, batch and
--quantization from the case. The trees alternate inside each case and the cases repeat --repeats
rounds, so drift in the device's state falls on both alike. Reported per case: each tree's median
decode tokens/s and MBU over the rounds, and this / base. A run that would not end inside
--budget-s (its case's longest run so far as the guide) is not started. Per-run logs and JSON lie
in --log-dir; the table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repo root
from benchmarks.timing import write_json  # noqa: E402

TREES = ("this", "base")
CASES = ("bf16:1", "int4:1", "fp8:1", "bf16:64")
METRICS = ("decode_tokens_per_s", "mbu")


def parse_case(text: str) -> tuple[str, int]:
    quant, _, batch = text.partition(":")
    if quant not in ("bf16", "int4", "fp8") or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"a case is QUANT:BATCH with QUANT bf16, int4 or fp8, got {text!r}")
    return quant, int(batch)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the baseline tree (run.py --export-baseline writes one)")
    ap.add_argument("--model", default="/tmp/ridge-llama3-8b-config", help="checkpoint both trees load (dummy weights)")
    ap.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in CASES],
                    metavar="QUANT:BATCH", help=f"default: {' '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=1, help="rounds (the trees alternate inside each)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--warmup-iters", type=int, default=1)
    ap.add_argument("--run-timeout", type=int, default=300, help="seconds one run may take")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run that would end past this")
    ap.add_argument("--log-dir", default="/tmp/ridge-ab")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.num_iters < 1 or a.warmup_iters < 0 or a.output_len < 2:
        ap.error("--repeats and --num-iters must be >= 1, --warmup-iters >= 0, --output-len >= 2")
    return a


def case_name(quant: str, batch: int) -> str:
    return f"{quant} b={batch}"


def tree_dir(a, tree: str) -> str:
    return ROOT if tree == "this" else os.path.abspath(a.baseline)


def run_env(tree_path: str, cache_dir: str) -> dict:
    return dict(os.environ, PYTHONPATH=tree_path, RIDGE_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1",
                TOKENIZERS_PARALLELISM="false")


def latency_cmd(a, quant: str, batch: int, json_path: str) -> list[str]:
    return [sys.executable, "-m", "ridge", "bench", "latency", "--model", os.path.abspath(a.model),
            "--load-format", "dummy", *(["--quantization", quant] if quant != "bf16" else []),
            "--batch-size", str(batch), "--input-len", "128", "--output-len", str(a.output_len),
            "--num-iters", str(a.num_iters), "--warmup-iters", str(a.warmup_iters), "--no-progress",
            "--json", json_path]


def run_one(a, tree: str, quant: str, batch: int, rnd: int) -> dict:
    name = f"{tree}_{quant}_b{batch}_r{rnd}"
    json_path, log_path = os.path.join(a.log_dir, f"{name}.json"), os.path.join(a.log_dir, f"{name}.log")
    path = tree_dir(a, tree)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(latency_cmd(a, quant, batch, json_path), cwd=path, stdout=log, stderr=subprocess.STDOUT,
                                env=run_env(path, os.path.join(a.log_dir, f"cache-{tree}")),
                                timeout=a.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    run = {"tree": tree, "case": case_name(quant, batch), "round": rnd, "rc": rc, "seconds": time.monotonic() - t0}
    if rc == 0:
        with open(json_path) as f:
            result = json.load(f)
        run["values"] = {k: result.get(k) for k in METRICS}
    return run


def summarize(runs: list[dict], cases: list[str]) -> dict:
    """Per case: each tree's median of each metric over its successful runs, and this / base of the
    decode rate (None where a side has no run)."""
    out = {}
    for case in cases:
        entry = {}
        for tree in TREES:
            for m in METRICS:
                vals = [r["values"][m] for r in runs if r["tree"] == tree and r["case"] == case and r.get("values")
                        and r["values"].get(m) is not None]
                entry[tree if m == "decode_tokens_per_s" else f"{tree}_{m}"] = statistics.median(vals) if vals else None
        entry["ratio"] = entry["this"] / entry["base"] if entry["this"] and entry["base"] else None
        out[case] = entry
    return out


def print_table(summary: dict) -> None:
    def f(x, spec):
        return "n/a" if x is None else format(x, spec)
    print(f"{'case':<10} {'this tok/s':>11} {'base tok/s':>11} {'this/base':>9} {'this MBU':>9} {'base MBU':>9}")
    for case, e in summary.items():
        print(f"{case:<10} {f(e['this'], '.1f'):>11} {f(e['base'], '.1f'):>11} {f(e['ratio'], '.3f'):>9} "
              f"{f(e['this_mbu'], '.1%'):>9} {f(e['base_mbu'], '.1%'):>9}")


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.log_dir, exist_ok=True)
    t0 = time.monotonic()
    cases = [case_name(q, b) for q, b in a.cases]
    result = {"baseline": os.path.abspath(a.baseline), "model": a.model, "cases": cases, "runs": [], "skipped": []}
    commit = os.path.join(a.baseline, "COMMIT")
    if os.path.isfile(commit):
        result["baseline_commit"] = open(commit).read().strip()
    longest: dict[str, float] = {}
    for rnd in range(a.repeats):
        for quant, batch in a.cases:
            for tree in TREES:
                case = case_name(quant, batch)
                guess = longest.get(case, 0.0)
                if a.budget_s is not None and time.monotonic() - t0 + guess > a.budget_s:
                    result["skipped"].append(f"{tree} {case} round {rnd}")
                    continue
                run = run_one(a, tree, quant, batch, rnd)
                longest[case] = max(guess, run["seconds"])
                result["runs"].append(run)
                print(f"{tree} {case} round {rnd}: rc={run['rc']} in {run['seconds']:.0f} s "
                      f"{run.get('values', '')}", flush=True)
                result["summary"] = summarize(result["runs"], cases)
                if a.json:
                    write_json(a.json, result)      # rewritten after every run: a timeout keeps what ran
    result["summary"] = summarize(result["runs"], cases)
    if a.json:
        write_json(a.json, result)
    print_table(result["summary"])
    return 0 if all(r["rc"] == 0 for r in result["runs"]) and not result["skipped"] else 1


if __name__ == "__main__":
    sys.exit(main())
