"""A/B of this tree against a baseline tree (a `git archive` export, benchmarks/make_baseline.sh),
in one device run, each measurement in its own process.

    python benchmarks/ab.py --model /tmp/ridge-llama3-8b --baseline .baseline/5e4f924 \\
        [--repeats 2] [--json $OUT/ab.json]

Each run is one subprocess of a tree's own benchmarks/fast_path.py (ridge only, no HF peer), with
PYTHONPATH and the working directory set to that tree, so each side runs its own engine, kernels
and benchmark code on the same checkpoint:
  (a) latency     batch 1, prompt 128, 256 greedy tokens: decode tok/s and the engine's own MBU
                  (bytes the decode steps must move / their time / the measured copy bandwidth);
  (b) throughput  64 requests, 512 -> 128, greedy, all at once: output tok/s;
  (c) workload    256 requests, lengths uniform in [100, 1024], temperature 0.6: output tok/s.
Variants: `this` (this tree), `base` (the baseline as it ships), and, on the baseline only, its
opt-in environment switches: base+pdl (RIDGE_PDL=1), base+fuse_norm (RIDGE_FUSE_NORM=1), both.
The switch variants run --variant-parts (default: (a) only, the decode step they change), plus a
one-request workload of 1024 -> 1024 tokens that is not reported: fast_path.py sizes the engine's
max_model_len from the parts it runs, and the decode graphs are captured for that length (it sets
the attention's split count), so every variant's engine must be sized as the full runs' are.
Runs are interleaved (this, base, base+pdl, ... then again), --repeats rounds, so drift in the
device's state spreads over all variants alike. Reported per variant and measurement: the median
over rounds, the spread ((max - min) / median) and the ratio to `base`. Also reported: the
fraction of this tree's batch-1 decode steps that overlapped (launched before the previous step's
ids were read back), from the latency JSON when the engine's bench reports it, else from
Engine.stats() after a batch-1 greedy generate in a separate process; the run fails if neither
gives it. A per-run log lies in --log-dir; the table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import json_option, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCHES = ("RIDGE_PDL", "RIDGE_FUSE_NORM")
VARIANTS = {            # name -> (tree: "this" | "base", environment switches turned on)
    "this": ("this", {}),
    "base": ("base", {}),
    "base+pdl": ("base", {"RIDGE_PDL": "1"}),
    "base+fuse_norm": ("base", {"RIDGE_FUSE_NORM": "1"}),
    "base+pdl+fuse_norm": ("base", {"RIDGE_PDL": "1", "RIDGE_FUSE_NORM": "1"}),
}
PARTS = ("latency", "throughput", "workload")
# (part, key in that part's ridge result, label)
METRICS = (("latency", "decode_tokens_per_s", "(a) b=1 decode tok/s"),
           ("latency", "mbu", "(a) b=1 MBU"),
           ("throughput", "output_tokens_per_s", "(b) 64x 512->128 output tok/s"),
           ("workload", "output_tokens_per_s", "(c) 256 req [100,1024] output tok/s"))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ridge-llama3-8b", help="checkpoint directory both trees load")
    ap.add_argument("--baseline", default=os.path.join(ROOT, ".baseline", "5e4f924"),
                    help="the baseline tree (benchmarks/make_baseline.sh writes it)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--parts", default=",".join(PARTS), help="fast_path parts of `this` and `base`")
    ap.add_argument("--variant-parts", default="latency", help="fast_path parts of the switch variants")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--latency-iters", type=int, default=4)
    ap.add_argument("--latency-warmup", type=int, default=1)
    ap.add_argument("--fast-path-args", default="", help="more fast_path.py arguments (smaller sizes for a CPU check)")
    ap.add_argument("--run-timeout", type=int, default=300, help="seconds one subprocess may take")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run once this many seconds have passed minus the longest run so far")
    json_option(ap, "ab.json", without_out="ab.json")
    ap.add_argument("--log-dir", default="/tmp/ridge-ab")
    ap.add_argument("--overlap-probe", action="store_true", help=argparse.SUPPRESS)   # the fallback's child
    a = ap.parse_args(argv)
    for name in ("parts", "variant_parts"):
        parts = [p.strip() for p in getattr(a, name).split(",") if p.strip()]
        if not parts or any(p not in PARTS for p in parts):
            ap.error(f"--{name.replace('_', '-')}: choose among {', '.join(PARTS)}")
        setattr(a, name, parts)
    if a.repeats < 1 or a.latency_iters < 1 or a.latency_warmup < 0:
        ap.error("--repeats and --latency-iters must be >= 1, --latency-warmup >= 0")
    return a


def tree_of(a, variant: str) -> str:
    return ROOT if VARIANTS[variant][0] == "this" else os.path.abspath(a.baseline)


def run_env(tree: str, switches: dict, cache_dir: str) -> dict:
    """The tree's own import path and ridge cache (the trees may store measured ceilings in
    different formats), the variant's switches and no others."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(switches, PYTHONPATH=tree, RIDGE_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    return env


# a workload part that only sizes the engine as the full runs' (max_model_len = 2 x 1024)
SIZING_WORKLOAD = ["--workload-num-prompts", "1", "--workload-len-range", "1024", "1024"]


def fast_path_cmd(a, tree: str, parts: list[str], json_path: str) -> list[str]:
    """fast_path.py running `parts`; a run without the workload gets the sizing one."""
    run_parts, sizing = list(parts), []
    if "workload" not in parts:
        run_parts.append("workload")
        sizing = SIZING_WORKLOAD
    return [sys.executable, os.path.join(tree, "benchmarks", "fast_path.py"), "--model", os.path.abspath(a.model),
            "--only", ",".join(run_parts), "--no-hf", "--no-progress", "--json", json_path,
            "--latency-iters", str(a.latency_iters), "--latency-warmup", str(a.latency_warmup),
            *sizing, *shlex.split(a.fast_path_args)]


def find_key(obj, key):
    """The first value under `key` anywhere in a nested dict/list (None if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def extract(fast_path_json: dict, reported=PARTS) -> dict:
    """{"part.key": value} from a fast_path.py result (its one model's ridge entries), for the
    parts in `reported`."""
    (parts,) = fast_path_json["models"].values()
    out = {}
    for part, key, _ in METRICS:
        r = parts.get(part, {}).get("ridge") if part in reported else None
        if r is not None:
            out[f"{part}.{key}"] = r.get(key)
    lat = parts.get("latency", {}).get("ridge")
    if lat is not None:
        out["latency.overlap_fraction"] = find_key(lat, "overlap_fraction")
        out["latency.commit"] = (lat.get("env") or {}).get("commit")
    return out


def run_one(a, variant: str, rnd: int) -> dict:
    tree = tree_of(a, variant)
    parts = a.parts if variant in ("this", "base") else a.variant_parts
    os.makedirs(a.log_dir, exist_ok=True)
    stem = os.path.join(a.log_dir, f"{variant}-{rnd}")
    cmd = fast_path_cmd(a, tree, parts, stem + ".json")
    t0 = time.perf_counter()
    with open(stem + ".log", "w") as log:
        try:
            env = run_env(tree, VARIANTS[variant][1], os.path.join(a.log_dir, f"cache-{VARIANTS[variant][0]}"))
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=a.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rec = {"variant": variant, "round": rnd, "parts": parts, "rc": rc, "wall_s": time.perf_counter() - t0,
           "log": stem + ".log"}
    if rc == 0:
        with open(stem + ".json") as f:
            rec["values"] = extract(json.load(f), parts)
    else:
        with open(stem + ".log") as f:
            tail = f.read().splitlines()[-25:]
        print(f"[ab] {variant} round {rnd} failed ({rc}):\n  " + "\n  ".join(tail), flush=True)
    return rec


def overlap_probe(model: str) -> None:
    """Child of the fallback: one batch-1 greedy generate, then Engine.stats() as JSON on stdout."""
    from ridge import LLM, SamplingParams
    llm = LLM(model=model, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for prompt in ([100 + i for i in range(128)], [300 + i for i in range(128)]):
        llm.generate([prompt], params)
    s = llm.engine.stats()
    print("OVERLAP " + json.dumps({"num_decode_steps": s.num_decode_steps,
                                   "num_overlapped_steps": s.num_overlapped_steps,
                                   "overlap_fraction": s.overlap_fraction}), flush=True)


def overlap_from_stats(a) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--overlap-probe", "--model", os.path.abspath(a.model)]
    env = run_env(ROOT, {}, os.path.join(a.log_dir, "cache-this"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.run_timeout)
    for line in p.stdout.splitlines():
        if line.startswith("OVERLAP "):
            stats = json.loads(line[8:])
            if stats["overlap_fraction"] is None:
                raise RuntimeError(f"Engine.stats() counted no static decode steps: {stats}")
            return {"source": "Engine.stats() after batch-1 greedy generates", **stats}
    raise RuntimeError(f"overlap probe failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def summarize(runs: list[dict], variants: list[str]) -> dict:
    table = {}
    for v in variants:
        table[v] = {}
        for part, key, _ in METRICS:
            vals = [r["values"][f"{part}.{key}"] for r in runs
                    if r["variant"] == v and r.get("values", {}).get(f"{part}.{key}") is not None]
            if vals:
                med = statistics.median(vals)
                table[v][f"{part}.{key}"] = {"values": vals, "median": med,
                                             "spread": (max(vals) - min(vals)) / med if med else None}
    for v in variants:
        for name, entry in table[v].items():
            base = table.get("base", {}).get(name)
            entry["ratio_to_base"] = entry["median"] / base["median"] if base and base["median"] else None
    return table


def print_table(result: dict) -> None:
    def f(x, spec):
        return "n/a" if x is None else format(x, spec)
    print(f"\nA/B: this tree vs {result['baseline']} on {result['model']}; {result['rounds_done']} interleaved "
          f"round(s); median over rounds, spread = (max-min)/median, ratio = median / base median")
    print(f"{'measurement':<38} {'variant':<19} {'median':>9} {'spread':>7} {'ratio':>6} {'n':>2}")
    for part, key, label in METRICS:
        for v, entries in result["summary"].items():
            e = entries.get(f"{part}.{key}")
            if e:
                spec = ".1%" if key == "mbu" else ".1f"
                print(f"{label:<38} {v:<19} {f(e['median'], spec):>9} {f(e['spread'], '.1%'):>7} "
                      f"{f(e['ratio_to_base'], '.3f'):>6} {len(e['values']):>2}")
    ov = result.get("overlap") or {}
    print(f"this tree, batch-1 decode steps overlapped: {f(ov.get('overlap_fraction'), '.1%')} "
          f"({ov.get('source', 'missing')})")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.overlap_probe:
        overlap_probe(a.model)
        return 0
    for v in a.variants:
        fp = os.path.join(tree_of(a, v), "benchmarks", "fast_path.py")
        if not os.path.isfile(fp):
            sys.exit(f"ab.py: {fp} missing (run benchmarks/make_baseline.sh; carry .baseline)")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit(f"ab.py: no checkpoint at {a.model}")
    t_start = time.perf_counter()
    result = {"model": a.model, "baseline": os.path.abspath(a.baseline), "variants": a.variants,
              "parts": a.parts, "variant_parts": a.variant_parts, "repeats": a.repeats, "runs": [],
              "rounds_done": 0, "skipped": []}

    def save():
        result["summary"] = summarize(result["runs"], a.variants)
        write_json(a.json, result)

    longest = 0.0
    for rnd in range(a.repeats):
        ran = 0
        for v in a.variants:
            elapsed = time.perf_counter() - t_start
            if a.budget_s is not None and elapsed + longest > a.budget_s:
                result["skipped"].append(f"{v} round {rnd}: {elapsed:.0f} s used, longest run {longest:.0f} s, "
                                         f"budget {a.budget_s:.0f} s")
                print(f"[ab] skip {v} round {rnd}: not enough budget left", flush=True)
                continue
            rec = run_one(a, v, rnd)
            ran += 1
            longest = max(longest, rec["wall_s"])
            result["runs"].append(rec)
            vals = rec.get("values", {})
            print(f"[ab] round {rnd} {v:<19} rc={rec['rc']} {rec['wall_s']:5.0f} s  decode "
                  f"{vals.get('latency.decode_tokens_per_s') or 0:.1f} tok/s  MBU {vals.get('latency.mbu') or 0:.1%}"
                  f"  (b) {vals.get('throughput.output_tokens_per_s') or 0:.0f}"
                  f"  (c) {vals.get('workload.output_tokens_per_s') or 0:.0f}", flush=True)
            save()
        result["rounds_done"] += ran == len(a.variants)
    # overlap of this tree's batch-1 decode steps: from its latency JSON, else from Engine.stats()
    fr = [r["values"].get("latency.overlap_fraction") for r in result["runs"]
          if r["variant"] == "this" and "values" in r]
    fr = [x for x in fr if x is not None]
    rc = 0
    if fr:
        result["overlap"] = {"source": "fast_path latency JSON (ridge bench latency)", "overlap_fraction":
                             statistics.median(fr), "values": fr}
    elif "this" in a.variants:
        try:
            result["overlap"] = overlap_from_stats(a)
        except Exception as e:  # noqa: BLE001 - recorded, and the run fails loudly below
            result["overlap"] = {"error": str(e)}
            print(f"[ab] ERROR: no overlap fraction from the latency JSON nor Engine.stats(): {e}", flush=True)
            rc = 1
    failed = [r for r in result["runs"] if r["rc"] != 0]
    if failed:
        rc = 1
    result["wall_s"] = time.perf_counter() - t_start
    save()
    print_table(result)
    if failed:
        print(f"[ab] {len(failed)} run(s) failed: " + ", ".join(f"{r['variant']}#{r['round']}" for r in failed))
    return rc


if __name__ == "__main__":
    sys.exit(main())
