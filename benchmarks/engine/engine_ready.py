"""Engine ready time: process start to an engine that can serve (weights in place, CUDA graphs
captured), on a model shape with `--load-format dummy` weights (no checkpoint read or written).

    python benchmarks/engine/engine_ready.py [--model DIR] [--preset llama3-8b] [--runs 2] [--json PATH]
    (JSON defaults to $OUT/engine_ready.json when OUT is set)

The model directory holds only config and tokenizer (`python -m ridge.utils.random_checkpoint DIR
--preset PRESET --config-only`, written here if missing). Each run is a fresh process that builds
`LLM(model=DIR, load_format="dummy")`; the runs share one compile cache (RIDGE_CACHE_DIR and
TRITON_CACHE_DIR under --cache-dir, emptied first), so run 1 is cold and the later ones warm.
Reported per run: process start -> ready (the figure the target applies to: Python and torch
imports, engine construction, weights, KV pool, graph capture), of which import and construction,
the engine's own breakdown (prefill warm-up, graph capture) and its log lines with their times.
After the timed part, a 4-token greedy generate checks that the engine works.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import json_option, write_json  # noqa: E402

T_PROCESS = time.time()      # a child's own start, as early as the module allows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ridge-llama3-8b-config", help="config + tokenizer directory")
    ap.add_argument("--preset", default="llama3-8b", help="random_checkpoint preset written when --model is empty")
    ap.add_argument("--runs", type=int, default=2, help="processes, one after another (1st cold, then warm)")
    ap.add_argument("--cache-dir", default="/tmp/ridge-ready-cache", help="compile caches (emptied first)")
    ap.add_argument("--target-s", type=float, default=15.0, help="warm process start -> ready target")
    ap.add_argument("--run-timeout", type=int, default=300)
    json_option(ap, "engine_ready.json", without_out="engine_ready.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    return a


def child(a) -> None:
    """One engine construction, timed; prints `READY {json}`."""
    import logging
    t_import0 = time.time()
    import torch

    from ridge import LLM, SamplingParams
    t_imported = time.time()
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append({"t_s": round(record.created - t_constructing, 3), "msg": record.getMessage()})
    logger = logging.getLogger("ridge")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    t_constructing = time.time()
    llm = LLM(model=a.model, load_format="dummy")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_ready = time.time()
    runner = llm.engine.runner
    graphs = getattr(runner, "decode_graphs", None)
    spawned = a.spawned_at if a.spawned_at is not None else T_PROCESS
    r = {"spawn_to_ready_s": t_ready - spawned, "process_to_ready_s": t_ready - T_PROCESS,
         "interpreter_start_s": T_PROCESS - spawned, "import_s": t_imported - t_import0,
         "construct_s": t_ready - t_constructing,
         "prefill_warm_up_s": getattr(runner, "warm_up_seconds", None),
         "decode_graph_capture_s": getattr(graphs, "capture_seconds", None),
         "graph_buckets": list(getattr(graphs, "buckets", []) or []),
         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "log": lines}
    try:
        out = llm.generate([[100, 200, 300, 400]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        r["check_tokens"] = list(out[0].outputs[0].token_ids)
        r["check_ok"] = len(r["check_tokens"]) == 4
    except Exception as e:  # noqa: BLE001 - reported; the timing stands
        r["check_ok"], r["check_error"] = False, f"{type(e).__name__}: {e}"
    print("READY " + json.dumps(r), flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        child(a)
        return 0
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        subprocess.run([sys.executable, "-m", "ridge.utils.random_checkpoint", a.model, "--preset", a.preset,
                        "--config-only"], check=True, env=env, cwd=root)
    shutil.rmtree(a.cache_dir, ignore_errors=True)
    env.update(RIDGE_CACHE_DIR=os.path.join(a.cache_dir, "ridge"), TRITON_CACHE_DIR=os.path.join(a.cache_dir, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(a.cache_dir, "inductor"))
    result = {"model": a.model, "preset": a.preset, "load_format": "dummy", "cache_dir": a.cache_dir,
              "target_s": a.target_s, "runs": []}
    rc = 0
    for i in range(a.runs):
        label = "cold" if i == 0 else "warm"
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model", a.model,
                            "--spawned-at", repr(t0)], env=env, cwd=root, capture_output=True, text=True,
                           timeout=a.run_timeout)
        run = {"cache": label, "rc": p.returncode, "wall_s": time.time() - t0}
        ready = [ln for ln in p.stdout.splitlines() if ln.startswith("READY ")]
        if p.returncode == 0 and ready:
            run.update(json.loads(ready[-1][6:]))
        else:
            run["error"] = (p.stdout + p.stderr)[-4000:]
            rc = 1
        result["runs"].append(run)
        print(f"[ready] run {i + 1} ({label} cache): rc={p.returncode} "
              f"spawn->ready {run.get('spawn_to_ready_s', float('nan')):.1f} s, construct "
              f"{run.get('construct_s', float('nan')):.1f} s, graph capture {run.get('decode_graph_capture_s')} s, "
              f"check {run.get('check_ok')}", flush=True)
        if "error" in run:
            print(run["error"][-2000:], flush=True)
    warm = [r["spawn_to_ready_s"] for r in result["runs"][1:] if "spawn_to_ready_s" in r]
    result["warm_spawn_to_ready_s"] = min(warm) if warm else None
    result["meets_target"] = bool(warm) and min(warm) <= a.target_s
    write_json(a.json, result)
    print(f"\nengine ready ({a.preset}, load_format=dummy), seconds")
    print(f"{'run':<4} {'cache':<5} {'spawn->ready':>12} {'import':>7} {'construct':>9} {'warm-up':>8} {'graphs':>7}")
    for i, r in enumerate(result["runs"]):
        f = lambda k: "n/a" if r.get(k) is None else f"{r[k]:.1f}"  # noqa: E731
        print(f"{i + 1:<4} {r['cache']:<5} {f('spawn_to_ready_s'):>12} {f('import_s'):>7} "
              f"{f('construct_s'):>9} {f('prefill_warm_up_s'):>8} {f('decode_graph_capture_s'):>7}")
    print(f"warm target <= {a.target_s:.0f} s: {'met' if result['meets_target'] else 'NOT met'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
