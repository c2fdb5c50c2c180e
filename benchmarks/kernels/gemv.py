"""GPU benchmark of ridge's small-batch GEMV (ridge/kernels/gemv.py) against cuBLAS (F.linear).

    python benchmarks/kernels/gemv.py [--json PATH] [--rows 1 2 4 8] [--models llama3-8b qwen3-0.6b]
                              [--sweep] [--skip-default] [--dry-run]

(JSON defaults to $OUT/gemv.json when OUT is set; --dry-run prints the plan without a GPU.)

Cases: the decode projections of Llama-3-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336, lm_head 128256x4096) and Qwen3-0.6B (qkv 4096x1024, o 1024x2048, gate_up
6144x1024, down 1024x3072, lm_head 151936x1024), N x K, bf16, at M = 1, 2, 4, 8 rows (the decode
CUDA-graph buckets). `down+silu` is the down projection fed the merged gate/up output [M, 2K]:
ridge fuses silu(gate) * up into the GEMV (one kernel); its peer is ridge's silu_and_mul kernel
and then F.linear (cuBLAS).

Timing: benchmarks/timing.py: each measurement is a CUDA graph of back-to-back calls (at least
--calls), replayed; the time per call is the replay time / calls, median of --reps replays after
warm-up, so kernel boundaries cost what they cost inside a decode graph (cuBLAS's split-K reduce
kernels included). The calls rotate through enough weight copies that the copies together exceed
twice the L2 (a weight is never re-read from L2), and through fresh random inputs (torch.randn).
GB/s = (weight + x + y bytes) / time; frac = that / the device's copy bandwidth, measured in the
same run (ridge.utils.ceilings.measure_bandwidth: a 1 GiB device copy, read + written).
`ridge/cuBLAS` is the ratio of times (< 1: ridge is faster). err = max |y - ref| / max |ref|
against an fp32 reference on the same bf16 inputs (silu in fp32, unrounded).

--sweep: for the Llama-3-8B projections at M = 1 and 8 (--sweep-rows), times a grid of configs
(BLOCK_N, BLOCK_K, num_warps, num_stages, dot) - configs that fail to compile are skipped - and
prints the best per shape beside the heuristic's choice (gemv_config), to set the heuristic from
data. Each config compiles once per distinct K and row class, ~0.5-1 s each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import (calls_for, copies_for, copy_bandwidth_gbps, json_option, l2_bytes as device_l2_bytes,  # noqa: E402
                    replay_options, time_calls, try_time, write_json)

from ridge.bench.common import fmt  # noqa: E402

DT = torch.bfloat16
# model -> [(projection, N, K, act)]
SHAPES = {
    "llama3-8b": [("qkv", 6144, 4096, None), ("o", 4096, 4096, None), ("gate_up", 28672, 4096, None),
                  ("down", 4096, 14336, None), ("down+silu", 4096, 14336, "silu_mul"),
                  ("lm_head", 128256, 4096, None)],
    "qwen3-0.6b": [("qkv", 4096, 1024, None), ("o", 1024, 2048, None), ("gate_up", 6144, 1024, None),
                   ("down", 1024, 3072, None), ("down+silu", 1024, 3072, "silu_mul"),
                   ("lm_head", 151936, 1024, None)],
}
SWEEP_MODEL, SWEEP_PROJECTIONS = "llama3-8b", ("qkv", "o", "gate_up", "down", "down+silu")
# (BLOCK_N, BLOCK_K, num_warps, num_stages, dot). FMA path: BLOCK_M * BLOCK_N * BLOCK_K / threads
# is the accumulator's registers per thread, so M = 8 gets only small tiles. Dot path: one warp
# per 16 rows of W (more would duplicate the MMA tile). num_stages 1 = direct register loads
# (evict_first kept), >= 2 = cp.async pipeline.
SWEEP_FMA_M1 = [(8, 512, 4, 1), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 4, 1), (16, 512, 4, 3),
                (16, 512, 4, 4), (16, 256, 4, 3), (16, 1024, 8, 3), (32, 256, 4, 1), (32, 256, 4, 3),
                (32, 512, 8, 3)]
SWEEP_FMA_M8 = [(8, 128, 4, 3), (8, 256, 8, 3), (16, 128, 8, 3)]
SWEEP_DOT = [(16, 128, 1, 4), (16, 256, 1, 3), (16, 256, 1, 4), (16, 256, 1, 6), (16, 512, 1, 3),
             (32, 256, 2, 3), (32, 256, 2, 4), (32, 512, 2, 3), (64, 128, 4, 4), (64, 256, 4, 3),
             (64, 256, 4, 4)]


def sweep_configs(M: int) -> list[tuple]:
    fma = SWEEP_FMA_M1 if M <= 2 else SWEEP_FMA_M8
    return [(*c, False) for c in fma] + [(*c, True) for c in SWEEP_DOT]


def cases(models, rows) -> list[dict]:
    return [dict(model=m, proj=p, N=N, K=K, act=act, M=M)
            for m in models for (p, N, K, act) in SHAPES[m] for M in rows]


def sweep_cases(rows) -> list[dict]:
    return [dict(model=SWEEP_MODEL, proj=p, N=N, K=K, act=act, M=M)
            for (p, N, K, act) in SHAPES[SWEEP_MODEL] if p in SWEEP_PROJECTIONS for M in rows]


def weight_copies(n: int, k: int, l2_bytes: int) -> int:
    """Weight copies whose total exceeds 2x L2, so no call finds its weight in L2."""
    return copies_for(n * k * DT.itemsize, l2_bytes)


calls_per_graph = calls_for     # a multiple of the copies, at least the minimum


def case_bytes(c: dict) -> int:
    kx = 2 * c["K"] if c["act"] else c["K"]
    return (c["N"] * c["K"] + c["M"] * kx + c["M"] * c["N"]) * DT.itemsize


class Operands:
    """Weight copies and per-call inputs/outputs for one case."""

    def __init__(self, c: dict, gen: torch.Generator, l2_bytes: int, min_calls: int):
        N, K, M = c["N"], c["K"], c["M"]
        kx = 2 * K if c["act"] else K
        self.copies = weight_copies(N, K, l2_bytes)
        self.calls = calls_per_graph(self.copies, min_calls)
        scale = K ** -0.5
        self.w = [(torch.randn(N, K, generator=gen, device="cuda") * scale).to(DT) for _ in range(self.copies)]
        self.x = [torch.randn(M, kx, generator=gen, device="cuda").to(DT) for _ in range(self.calls)]
        self.y = [torch.empty(M, N, device="cuda", dtype=DT) for _ in range(self.calls)]


def ridge_fns(c, ops: Operands, config=None):
    from ridge.kernels.gemv import gemv
    return [(lambda i=i: gemv(ops.x[i], ops.w[i % ops.copies], act=c["act"], out=ops.y[i], config=config))
            for i in range(ops.calls)]


def cublas_fns(c, ops: Operands):
    import torch.nn.functional as F

    from ridge.kernels.silu_mul import silu_and_mul
    if c["act"] == "silu_mul":
        return [(lambda i=i: F.linear(silu_and_mul(ops.x[i]), ops.w[i % ops.copies])) for i in range(ops.calls)]
    return [(lambda i=i: F.linear(ops.x[i], ops.w[i % ops.copies])) for i in range(ops.calls)]


def max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_case(c, gen, l2_bytes, copy_gbps, args) -> dict:
    from ridge.kernels.gemv import gemv, gemv_config, gemv_ref
    ops = Operands(c, gen, l2_bytes, args.calls)
    nbytes = case_bytes(c)
    cfg = gemv_config(c["M"], c["N"], c["K"], torch.cuda.get_device_properties(0).multi_processor_count)
    res = {**c, "bytes": nbytes, "config": list(cfg), "weight_copies": ops.copies, "calls_per_graph": ops.calls}
    x, w = ops.x[0], ops.w[0]
    ref = gemv_ref(x.float(), w.float(), act=c["act"])
    res["ridge_err"] = max_err(gemv(x, w, act=c["act"]), ref)
    res["cublas_err"] = max_err(cublas_fns(c, ops)[0](), ref)
    del ref
    for peer, fns in (("ridge", ridge_fns(c, ops)), ("cublas", cublas_fns(c, ops))):
        t = try_time(peer, lambda fns=fns: time_calls(fns, sets=ops.copies, reps=args.reps))
        us = None if t is None else t.median_us
        res[f"{peer}_us"] = us
        res[f"{peer}_GBps"] = None if us is None else nbytes / (us * 1e-6) / 1e9
        res[f"{peer}_frac"] = None if us is None else res[f"{peer}_GBps"] / copy_gbps
    res["ridge_over_cublas"] = res["ridge_us"] / res["cublas_us"] if res["ridge_us"] and res["cublas_us"] else None
    return res


def run_sweep_case(c, gen, l2_bytes, copy_gbps, args) -> dict:
    from ridge.kernels.gemv import gemv_config
    ops = Operands(c, gen, l2_bytes, args.calls)
    nbytes = case_bytes(c)
    heur = tuple(gemv_config(c["M"], c["N"], c["K"], torch.cuda.get_device_properties(0).multi_processor_count))
    configs = sweep_configs(c["M"])
    if heur not in configs:
        configs.append(heur)
    out = {**c, "bytes": nbytes, "heuristic": list(heur), "results": []}
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            us = time_calls(ridge_fns(c, ops, cfg), sets=ops.copies, reps=args.sweep_reps).median_us
            out["results"].append({"config": list(cfg), "us": us, "frac": nbytes / (us * 1e-6) / 1e9 / copy_gbps})
        except Exception as e:  # noqa: BLE001 - out of resources / compile failure: skip the config
            out["results"].append({"config": list(cfg), "us": None, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        if args.verbose:
            r = out["results"][-1]
            print(f"    {cfg} {fmt(r['us'], '.1f')} us ({time.perf_counter() - t0:.1f} s)", flush=True)
    ok = [r for r in out["results"] if r["us"] is not None]
    out["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    out["heuristic_us"] = next((r["us"] for r in out["results"] if tuple(r["config"]) == heur), None)
    return out


# ----------------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    json_option(ap, "gemv.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="M values (<= 8)")
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--only", nargs="+", default=None, help="projection names to keep (e.g. o down+silu)")
    replay_options(ap, reps=30)
    ap.add_argument("--sweep", action="store_true", help="also time a config grid on the Llama-3-8B shapes")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sweep-reps", type=int, default=20)
    ap.add_argument("--skip-default", action="store_true", help="only the sweep")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    from ridge.kernels.gemv import GEMV_MAX_ROWS
    if any(not 1 <= m <= GEMV_MAX_ROWS for m in args.rows + args.sweep_rows):
        ap.error(f"--rows / --sweep-rows must be in 1..{GEMV_MAX_ROWS}")
    if args.calls < 1 or args.reps < 1 or args.sweep_reps < 1:
        ap.error("--calls, --reps and --sweep-reps must be positive")
    known = {p for m in SHAPES.values() for (p, *_) in m}
    if args.only and not set(args.only) <= known:
        ap.error(f"--only: unknown projection(s) {sorted(set(args.only) - known)}; known: {sorted(known)}")
    return args


def plan(args) -> tuple[list[dict], list[dict]]:
    default = [] if args.skip_default else [
        c for c in cases(args.models, args.rows) if not args.only or c["proj"] in args.only]
    sweep = [c for c in sweep_cases(args.sweep_rows) if not args.only or c["proj"] in args.only] if args.sweep else []
    return default, sweep


def print_plan(default, sweep, l2_bytes=50 << 20):
    from ridge.kernels.gemv import gemv_config
    print(f"{len(default)} cases, {len(sweep)} sweep cases ({sum(len(sweep_configs(c['M'])) for c in sweep)} timings)")
    for c in default:
        copies = weight_copies(c["N"], c["K"], l2_bytes)
        print(f"  {c['model']:<11} {c['proj']:<10} M={c['M']} N={c['N']:>6} K={c['K']:>5} "
              f"{case_bytes(c) / 1e6:8.1f} MB  copies={copies:>2} calls={calls_per_graph(copies, 20):>2}  "
              f"config={tuple(gemv_config(c['M'], c['N'], c['K']))}")
    for c in sweep:
        print(f"  sweep {c['proj']:<10} M={c['M']}: {len(sweep_configs(c['M']))} configs")


def main(argv=None) -> None:
    args = parse_args(argv)
    default, sweep = plan(args)
    if args.dry_run:
        print_plan(default, sweep)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/gemv.py needs a CUDA GPU (--dry-run prints the plan; the kernel's CPU "
                 "checks are tests/kernels/test_gemv.py under TRITON_INTERPRET=1)")
    import triton

    t_start = time.perf_counter()
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = device_l2_bytes()
    copy_gbps = copy_bandwidth_gbps()
    result = {"device": torch.cuda.get_device_name(), "sms": props.multi_processor_count, "l2_bytes": l2_bytes,
              "torch": torch.__version__, "triton": triton.__version__, "seed": seed, "dtype": str(DT),
              "copy_GBps": copy_gbps, "calls_min": args.calls, "reps": args.reps, "rows": [], "sweep": []}
    for c in default:
        print(f"{c['model']} {c['proj']} M={c['M']} ...", flush=True)
        result["rows"].append(run_case(c, gen, l2_bytes, copy_gbps, args))
        torch.cuda.empty_cache()
    for c in sweep:
        print(f"sweep {c['proj']} M={c['M']} ({len(sweep_configs(c['M']))} configs) ...", flush=True)
        result["sweep"].append(run_sweep_case(c, gen, l2_bytes, copy_gbps, args))
        torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - t_start
    if args.json:
        write_json(args.json, result)

    if result["sweep"]:
        print("\nsweep (BLOCK_N, BLOCK_K, warps, stages, dot): best vs heuristic, us and frac of copy bandwidth")
        for s in result["sweep"]:
            b = s["best"]
            failed = sum(r["us"] is None for r in s["results"])
            top = sorted((r for r in s["results"] if r["us"] is not None), key=lambda r: r["us"])[:3]
            print(f"  {s['proj']:<10} M={s['M']} best {tuple(b['config']) if b else None} {fmt(b and b['us'], '.1f')} us "
                  f"{fmt(b and b['frac'], '.2f')} | heuristic {tuple(s['heuristic'])} {fmt(s['heuristic_us'], '.1f')} us"
                  f" | next {[(tuple(r['config']), round(r['us'], 1)) for r in top[1:]]}"
                  + (f" | {failed} failed" if failed else ""))
    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s  bf16, seed {seed}, "
          f"{result['wall_s']:.0f} s")
    print("CUDA-graph replays; frac = (W + x + y bytes / time) / copy bandwidth; ratio = ridge/cuBLAS time; "
          "err = max|y - ref| / max|ref| vs fp32")
    print(f"{'model':<11} {'proj':<10}{'M':>2} {'ridge us':>9} {'frac':>5} {'cuBLAS us':>9} {'frac':>5} "
          f"{'ratio':>6} {'err ridge':>9} {'cuBLAS':>8}  config")
    for r in result["rows"]:
        print(f"{r['model']:<11} {r['proj']:<10}{r['M']:>2} {fmt(r['ridge_us'], '.1f'):>9} {fmt(r['ridge_frac'], '.2f'):>5} "
              f"{fmt(r['cublas_us'], '.1f'):>9} {fmt(r['cublas_frac'], '.2f'):>5} {fmt(r['ridge_over_cublas'], '.2f'):>6} "
              f"{r['ridge_err']:>9.1e} {r['cublas_err']:>8.1e}  {tuple(r['config'])}")


if __name__ == "__main__":
    main()
