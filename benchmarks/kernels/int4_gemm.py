"""GPU benchmark of ridge's W4A16 kernels (ridge/kernels/int4_matmul.py) against cuBLAS bf16 and
torch's tinygemm int4, on the Llama-3-8B and -70B projection shapes.

    python benchmarks/kernels/int4_gemm.py [--json PATH] [--rows 1 2 4 ...] [--models llama3-8b llama3-70b]
                                   [--only o down] [--splits 1 2 4 8 16 32] [--dry-run]
                                   [--gemv-configs 128,128,4,4 ...] [--gemm-configs 64,128,64,4,4 ...]

(JSON defaults to $OUT/int4_gemm.json when OUT is set; --dry-run prints the plan without a GPU.)

Cases: N x K = qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336, lm_head
128256 x 4096 (8B: the LM head, which ridge keeps in bf16, to weigh quantizing it too);
qkv 10240 x 8192, o 8192 x 8192, gate_up 57344 x 8192, down 8192 x 28672, kv 1024 x 8192 (70B:
one of k / v, the shape tensor parallelism leaves), at M = 1 ... 512 rows, bf16 activations,
group size 128. Peers, on the same quantized weight:
  * ridge: int4_matmul(x, qweight, scales, zeros, 128), ridge's layout.
  * cuBLAS bf16: F.linear(x, W) with the dequantized weight in bf16 [N, K].
  * tinygemm: torch.ops.aten._weight_int4pack_mm(x, packed, 128, scales_and_zeros), the weight
    converted by _convert_weight_to_int4pack(uint8 [N, K / 2], inner_k_tiles=8) and the zero
    point written its way, w = (q - 8) s + (8 - z) s. "unavailable" where the op is missing.
  * dequant (M >= 64): the engine's other INT4 path, int4_dispatch.dequant_matmul: the weight written
    in bf16 by ridge/kernels/int4_dequant.py, then cuBLAS (x deq = dequant time / ridge time).
Correctness first: every peer's output on the first input set against an fp32 reference of the
same dequantized weight (err = max |y - ref| / max |ref|); a ridge result over 1e-2 is reported
WRONG and not timed.

Timing: benchmarks/timing.py: a CUDA graph of back-to-back calls (>= --calls), replayed --reps
times, the median time per call; each peer's calls rotate through enough weight copies that the
copies together exceed twice the L2 (no weight is read from L2) and through fresh random inputs
(never zeros). Peers run one after the other in the same process, on the same device.
frac = (INT4 weight + scales + zeros + x + y bytes) / ridge time / the copy bandwidth measured in
the same run (bf16: W + x + y bytes). x bf16 = bf16 time / ridge time, x tiny = tinygemm / ridge.
Targets (issue 15): >= 3.3x bf16 at M = 1, >= 3.0x at M = 16, never slower than bf16, faster than
tinygemm at every M.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import (calls_for, copies_for, copy_bandwidth_gbps, cuda_run, json_option, print_plan,  # noqa: E402
                    replay_options, run_plan, short_error, time_calls, try_time)

from ridge.bench.common import fmt  # noqa: E402

DT = torch.bfloat16
GROUP = 128
SHAPES = {
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                  ("lm_head", 128256, 4096)],
    "llama3-70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672),
                   ("kv", 1024, 8192)],
}
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
TARGETS = {1: 3.3, 16: 3.0}            # x cuBLAS bf16 at these M (issue 15)
WRONG = 1e-2


def int4_bytes(c: dict, group: int = GROUP) -> int:
    """Bytes the INT4 kernel must move: packed weight, scales and zeros (2 bytes each per group
    and column), x in, y out."""
    N, K, M = c["N"], c["K"], c["M"]
    return N * K // 2 + 2 * 2 * (K // group) * N + 2 * (M * K + M * N)


def bf16_bytes(c: dict) -> int:
    return 2 * (c["N"] * c["K"] + c["M"] * c["K"] + c["M"] * c["N"])


def sets_for(N: int, K: int, M: int, l2: int) -> int:
    """INT4 weight copies whose total exceeds 2x L2."""
    return copies_for(int4_bytes(dict(N=N, K=K, M=M)), l2)


def cases(args) -> list[dict]:
    return [dict(model=m, proj=p, N=N, K=K, M=M) for m in args.models for (p, N, K) in SHAPES[m]
            if not args.only or p in args.only for M in args.rows]


def quantized(N: int, K: int, gen: torch.Generator):
    """A random INT4 weight in ridge's layout (never zeros: q uniform in [0, 15], zeros integer in
    [0, 15], scales ~ 1 / sqrt(K))."""
    from ridge.kernels.int4_matmul import pack_int4
    q = torch.randint(0, 16, (K, N), generator=gen, device="cuda", dtype=torch.int32)
    s = ((torch.rand(K // GROUP, N, generator=gen, device="cuda") + 0.5) * 0.2 / K**0.5).to(DT)
    z = torch.randint(0, 16, (K // GROUP, N), generator=gen, device="cuda").to(DT)
    return q, pack_int4(q), s, z


def tinygemm_weight(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor):
    """ridge's q [K, N] and tables -> tinygemm's packed weight and [K / G, N, 2] scales-and-zeros
    (its dequant is (q - 8) s + zt, so zt = (8 - z) s)."""
    qt = q.t().contiguous()
    w_uint8 = ((qt[:, ::2] << 4) | qt[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(w_uint8, 8)
    sz = torch.stack([s.float(), (8 - z.float()) * s.float()], dim=2).to(DT).contiguous()
    return packed, sz


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_case(c: dict, gen, l2: int, copy_gbps: float, args) -> dict:
    import torch.nn.functional as F

    from ridge.kernels.int4_matmul import dequantize_int4, int4_matmul
    from ridge.layers.quant.int4.dispatch import MIN_ROWS, dequant_matmul
    N, K, M = c["N"], c["K"], c["M"]
    res = {**c, "int4_bytes": int4_bytes(c), "bf16_bytes": bf16_bytes(c)}
    n_i4 = copies_for(int4_bytes(c), l2)
    calls = calls_for(n_i4, args.calls)
    xs = [torch.randn(M, K, generator=gen, device="cuda").to(DT) for _ in range(calls)]
    q, qw, s, z = quantized(N, K, gen)
    w = dequantize_int4(qw, s, z, GROUP)
    ref = xs[0].float() @ w
    w_bf16 = w.t().contiguous().to(DT)
    del w
    peers = {}
    # ridge: set 0 is checked, the other copies are fresh random weights of the same shape
    ridge_sets = [(qw, s, z)] + [quantized(N, K, gen)[1:] for _ in range(n_i4 - 1)]
    res["ridge_err"] = rel_err(int4_matmul(xs[0], qw, s, z, GROUP), ref)
    if res["ridge_err"] <= WRONG:
        peers["ridge"] = ([(lambda i=i: int4_matmul(xs[i], *ridge_sets[i % n_i4], GROUP)) for i in range(calls)], n_i4)
    else:
        print(f"  ridge WRONG: err {res['ridge_err']:.2e} > {WRONG} (not timed)", flush=True)
    n_bf = copies_for(N * K * 2, l2)
    bf_sets = [w_bf16] + [(torch.randn(N, K, generator=gen, device="cuda") * K**-0.5).to(DT) for _ in range(n_bf - 1)]
    cb = calls_for(n_bf, args.calls)
    xb = xs * (cb // len(xs) + 1)
    res["bf16_err"] = rel_err(F.linear(xs[0], w_bf16), ref)
    peers["bf16"] = ([(lambda i=i: F.linear(xb[i], bf_sets[i % n_bf])) for i in range(cb)], n_bf)
    try:
        tg = tinygemm_weight(q, s, z)
        res["tinygemm_err"] = rel_err(torch.ops.aten._weight_int4pack_mm(xs[0], tg[0], GROUP, tg[1]), ref)
        tg_sets = [tg] + [tinygemm_weight(q_, s_, z_) for q_, _, s_, z_ in (quantized(N, K, gen) for _ in range(n_i4 - 1))]
        peers["tinygemm"] = ([(lambda i=i: torch.ops.aten._weight_int4pack_mm(xs[i], tg_sets[i % n_i4][0], GROUP,
                                                                              tg_sets[i % n_i4][1]))
                              for i in range(calls)], n_i4)
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        res["tinygemm_err"] = None
        res["tinygemm_unavailable"] = short_error(e)
        print(f"  tinygemm unavailable ({res['tinygemm_unavailable']})", flush=True)
    if M >= MIN_ROWS:     # the engine's other INT4 path at these rows: the weight dequantized, then cuBLAS
        res["dequant_err"] = rel_err(dequant_matmul(xs[0], qw, s, z, GROUP), ref)
        peers["dequant"] = ([(lambda i=i: dequant_matmul(xs[i], *ridge_sets[i % n_i4], GROUP)) for i in range(calls)],
                            n_i4)
    del ref
    for name, (fns, sets) in peers.items():
        t = try_time(name, lambda fns=fns, sets=sets: time_calls(fns, sets=sets, reps=args.reps))
        if t is not None:
            res[f"{name}_us"], res[f"{name}_spread"], res[f"{name}_sets"] = t.median_us, t.spread, sets
    if args.splits and M <= 64 and "ridge" in peers:
        res["split_sweep"] = sweep_splits(xs, ridge_sets, calls, n_i4, args)
    if (args.gemv_configs or args.gemm_configs) and "ridge" in peers:
        res["config_sweep"] = sweep_configs(xs, ridge_sets, calls, n_i4, args)
    r_us, b_us, t_us = res.get("ridge_us"), res.get("bf16_us"), res.get("tinygemm_us")
    res["x_bf16"] = b_us / r_us if r_us and b_us else None
    res["x_tinygemm"] = t_us / r_us if r_us and t_us else None
    res["x_dequant"] = res["dequant_us"] / r_us if r_us and res.get("dequant_us") else None
    res["ridge_frac"] = int4_bytes(c) / (r_us * 1e-6) / 1e9 / copy_gbps if r_us else None
    res["bf16_frac"] = bf16_bytes(c) / (b_us * 1e-6) / 1e9 / copy_gbps if b_us else None
    res["ridge_tflops"] = 2 * M * N * K / (r_us * 1e-6) / 1e12 if r_us else None
    res["bf16_tflops"] = 2 * M * N * K / (b_us * 1e-6) / 1e12 if b_us else None
    return res


def time_each(configs, call, xs, ridge_sets, calls: int, n_i4: int, reps: int) -> tuple[dict, dict]:
    """Time call(i, cfg) over the rotating inputs for each (label, cfg) of configs, each first checked
    against the fp32 reference on input set 0: ({label: us}, {label: why not timed})."""
    from ridge.kernels.int4_matmul import dequantize_int4
    ref = xs[0].float() @ dequantize_int4(*ridge_sets[0], GROUP)
    us, wrong = {}, {}
    for label, cfg in configs:
        try:
            err = rel_err(call(0, cfg), ref)
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is reported
            wrong[label] = short_error(e)
            continue
        if err > WRONG:
            wrong[label] = f"err {err:.2e}"
            continue
        t = try_time(str(label), lambda cfg=cfg: time_calls([(lambda i=i: call(i, cfg)) for i in range(calls)],
                                                            sets=n_i4, reps=reps))
        if t is not None:
            us[label] = t.median_us
    return us, wrong


def skinny_call(xs, ridge_sets, n_i4: int):
    """call(i, cfg): the skinny kernel on input set i at launch config cfg, into its own output."""
    from ridge.kernels import int4_gemv as gv
    outs = [torch.empty(x.shape[0], ridge_sets[0][0].shape[1], device="cuda", dtype=DT) for x in xs]
    return lambda i, cfg: gv.int4_gemv(xs[i], *ridge_sets[i % n_i4], GROUP, outs[i], cfg)


def engine_skinny_config(xs, ridge_sets):
    from ridge.kernels import int4_gemv as gv
    M, K = xs[0].shape
    return gv.int4_gemv_config(M, ridge_sets[0][0].shape[1], K, GROUP,
                               torch.cuda.get_device_properties(0).multi_processor_count)


def sweep_splits(xs, ridge_sets, calls: int, n_i4: int, args) -> dict:
    """The skinny kernel at each split-K of --splits that divides the K tiles (the heuristic's
    other choices fixed): {split: us}, and the heuristic's own pick, to set split_k_for from data."""
    heur = engine_skinny_config(xs, ridge_sets)
    tiles = -(-xs[0].shape[1] // heur.block_k)
    configs = [(split, heur._replace(split_k=split)) for split in args.splits if tiles % split == 0]
    us, wrong = time_each(configs, skinny_call(xs, ridge_sets, n_i4), xs, ridge_sets, calls, n_i4, args.reps)
    return {"heuristic": heur.split_k, "us": us, "wrong": wrong}


def parse_config(text: str, counts: tuple[int, ...]) -> tuple[int, ...] | None:
    """'128,128,4,4' -> (128, 128, 4, 4); None unless it is `counts` positive integers."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        return None
    return vals if len(vals) in counts and min(vals) >= 1 else None


def sweep_configs(xs, ridge_sets, calls: int, n_i4: int, args) -> dict:
    """The kernel int4_matmul takes at this M (the skinny kernel at M <= 32, else the GEMM) at each
    launch config of --gemv-configs (BLOCK_N,BLOCK_K,warps,stages[,split]: the heuristic's split when
    none is given) or --gemm-configs (BLOCK_M,BLOCK_N,BLOCK_K,warps,stages[,split]): {label: us} beside the
    config the engine takes, each checked against the reference first (a wrong one is not timed)."""
    from ridge.kernels import int4_gemv as gv
    from ridge.kernels.int4_gemm import Int4GemmConfig, int4_gemm
    M, K = xs[0].shape
    if M <= gv.GEMV_MAX_M:
        heur = engine_skinny_config(xs, ridge_sets)
        engine, configs = ",".join(map(str, heur)), []
        for text in args.gemv_configs or []:
            v = parse_config(text, (4, 5))
            cfg = gv.Int4GemvConfig(*v[:4], v[4] if len(v) == 5 else heur.split_k)
            if -(-K // cfg.block_k) % cfg.split_k == 0:
                configs.append((",".join(map(str, cfg)), cfg))
        call = skinny_call(xs, ridge_sets, n_i4)
    else:
        engine = "autotuned"
        configs = [(text, Int4GemmConfig(*parse_config(text, (5, 6)))) for text in args.gemm_configs or []]
        outs = [torch.empty(M, ridge_sets[0][0].shape[1], device="cuda", dtype=DT) for _ in xs]

        def call(i, cfg):
            return int4_gemm(xs[i], *ridge_sets[i % n_i4], GROUP, outs[i], cfg)
    us, wrong = time_each(configs, call, xs, ridge_sets, calls, n_i4, args.reps)
    return {"engine": engine, "us": us, "wrong": wrong}


def verdicts(rows: list[dict]) -> dict:
    """The issue's targets over the rows that have the numbers."""
    out = {}
    for m, target in TARGETS.items():
        xs = [r["x_bf16"] for r in rows if r["M"] == m and r.get("x_bf16")]
        out[f"x_bf16_at_M{m}"] = {"target": target, "min": min(xs) if xs else None,
                                  "met": bool(xs) and min(xs) >= target}
    xs = [r["x_bf16"] for r in rows if r.get("x_bf16")]
    out["never_slower_than_bf16"] = {"min": min(xs) if xs else None, "met": bool(xs) and min(xs) >= 1.0}
    xt = [r["x_tinygemm"] for r in rows if r.get("x_tinygemm")]
    out["faster_than_tinygemm"] = {"min": min(xt) if xt else None, "met": bool(xt) and min(xt) > 1.0}
    out["all_correct"] = all(r["ridge_err"] <= WRONG for r in rows)
    return out


# ----------------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    json_option(ap, "int4_gemm.json")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS, help="M values")
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--only", nargs="+", default=None, help="projection names to keep (e.g. o down)")
    replay_options(ap, reps=30)
    ap.add_argument("--splits", type=int, nargs="*", default=None,
                    help="also time the M <= 64 kernel at these split-K values (e.g. 1 2 4 8 16 32)")
    ap.add_argument("--gemv-configs", nargs="*", default=None, metavar="BN,BK,W,S[,SPLIT]",
                    help="also time the skinny kernel (M <= 32) at these launch configs")
    ap.add_argument("--gemm-configs", nargs="*", default=None, metavar="BM,BN,BK,W,S[,SPLIT]",
                    help="also time the GEMM (M > 32) at these tiles instead of the autotuner's")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.rows) or any(v < 1 for v in args.splits or []):
        ap.error("--rows and --splits must be positive")
    if args.calls < 1 or args.reps < 1:
        ap.error("--calls and --reps must be positive")
    for flag, texts, counts in (("--gemv-configs", args.gemv_configs, (4, 5)), ("--gemm-configs", args.gemm_configs, (5, 6))):
        bad = [t for t in texts or [] if parse_config(t, counts) is None]
        if bad:
            ap.error(f"{flag}: {bad} are not {' or '.join(map(str, counts))} comma-separated positive integers")
    known = {p for m in SHAPES.values() for (p, *_) in m}
    if args.only and not set(args.only) <= known:
        ap.error(f"--only: unknown projection(s) {sorted(set(args.only) - known)}; known: {sorted(known)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = cases(args)
    if args.dry_run:
        return print_plan(plan, lambda c: f"{c['model']:<10} {c['proj']:<8} M={c['M']:<4} N={c['N']:>6} K={c['K']:>6} "
                                          f"int4 {int4_bytes(c) / 1e6:7.1f} MB  bf16 {bf16_bytes(c) / 1e6:7.1f} MB  "
                                          f"int4 copies {sets_for(c['N'], c['K'], c['M'], 50 << 20)}")
    seed, gen, l2 = cuda_run("int4_gemm.py", "tests/kernels/test_int4_kernels.py")
    import triton

    copy_gbps = copy_bandwidth_gbps()
    result = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "l2_bytes": l2, "torch": torch.__version__, "triton": triton.__version__, "seed": seed,
              "dtype": str(DT), "group_size": GROUP, "copy_GBps": copy_gbps, "calls_min": args.calls,
              "reps": args.reps, "rows": []}
    run_plan(plan, lambda c: run_case(c, gen, l2, copy_gbps, args), result, verdicts, args.json)

    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s  bf16 x, INT4 g{GROUP} weights, "
          f"seed {seed}, {result['wall_s']:.0f} s")
    print("CUDA-graph medians (us); x bf16 / x tiny = peer time / ridge time; frac = INT4 bytes / time / copy bw; "
          "err = max|y - ref| / max|ref| vs fp32")
    print(f"{'model':<10} {'proj':<8}{'M':>4} {'ridge':>8} {'bf16':>8} {'tiny':>8} {'dequant':>8} {'x bf16':>7} "
          f"{'x tiny':>7} {'x deq':>6} {'frac':>5} {'TF/s':>6} {'err':>8}")
    for r in result["rows"]:
        print(f"{r['model']:<10} {r['proj']:<8}{r['M']:>4} {fmt(r.get('ridge_us'), '.1f'):>8} "
              f"{fmt(r.get('bf16_us'), '.1f'):>8} "
              f"{'unavail' if r.get('tinygemm_unavailable') else fmt(r.get('tinygemm_us'), '.1f'):>8} "
              f"{fmt(r.get('dequant_us'), '.1f'):>8} {fmt(r['x_bf16'], '.2f'):>7} {fmt(r['x_tinygemm'], '.2f'):>7} "
              f"{fmt(r['x_dequant'], '.2f'):>6} {fmt(r['ridge_frac'], '.2f'):>5} "
              f"{fmt(r['ridge_tflops'], '.0f'):>6} {r['ridge_err']:>8.1e}" + ("  WRONG" if r["ridge_err"] > WRONG else ""))
    sweeps = [r for r in result["rows"] if r.get("split_sweep")]
    if sweeps:
        print("split-K sweep (us per split; * = the heuristic's pick)")
        for r in sweeps:
            sw = r["split_sweep"]
            print(f"  {r['model']:<10} {r['proj']:<8} M={r['M']:<3} " + "  ".join(
                f"{k}{'*' if k == sw['heuristic'] else ''}: {v:.1f}" for k, v in sw["us"].items()))
    sweeps = [r for r in result["rows"] if r.get("config_sweep")]
    if sweeps:
        print("config sweep (us; engine = the config int4_matmul takes; best marked)")
        for r in sweeps:
            sw = r["config_sweep"]
            best = min(sw["us"], key=sw["us"].get) if sw["us"] else None
            print(f"  {r['model']:<10} {r['proj']:<8} M={r['M']:<3} ridge {fmt(r.get('ridge_us'), '.1f')} "
                  f"(engine {sw['engine']})  " + "  ".join(f"{k}{'*' if k == best else ''}: {v:.1f}"
                                                            for k, v in sw["us"].items())
                  + (f"  wrong/failed: {sw['wrong']}" if sw["wrong"] else ""))
    v = result["verdicts"]
    print("targets: " + "; ".join(f"{k} {fmt(e.get('min'), '.2f')}"
                                  + (f" (>= {e['target']})" if "target" in e else "") + (" met" if e["met"] else " NOT met")
                                  for k, e in v.items() if isinstance(e, dict))
          + f"; all ridge results correct: {v['all_correct']}")


if __name__ == "__main__":
    main()
