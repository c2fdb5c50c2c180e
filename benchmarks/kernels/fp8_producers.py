"""GPU benchmark of the FP8 producers: the kernels before an FP8 GEMM with the activation
quantization fused in (ridge/kernels/rmsnorm.py rms_norm_fp8, silu_mul.py silu_and_mul_fp8)
against the same kernel followed by the separate quantization pass (quantize_act_fp8), what an FP8
layer runs where no producer quantizes for it.

    python benchmarks/kernels/fp8_producers.py [--json PATH] [--tokens 1 64 512 4096] [--dry-run]

(JSON defaults to $OUT/fp8_producers.json when OUT is set; --dry-run prints the plan without a GPU.)
Llama-3-8B shapes, bf16 in: hidden 4096, intermediate 14336. Cases, each at T tokens:

  norm   RMSNorm with the residual add (the decoder's norm before QKV and gate-up):
         separate: rms_norm (read x, r, w; write out, x + r), then quantize_act_fp8 (read out;
         write e4m3 + scales); fused: rms_norm_fp8 (read x, r, w; write x + r, e4m3 + scales)
  silu   SiLU-and-mul (before down): separate: silu_and_mul ([T, 2I] -> [T, I] bf16), then
         quantize_act_fp8; fused: silu_and_mul_fp8 ([T, 2I] -> e4m3 [T, I] + scales)

Each variant's bytes are the minimum it must move (every input read once, every output written
once, the separate pass's bf16 intermediate written and read back); GB/s = those bytes / time and
`frac` = GB/s / the device's copy bandwidth, measured in the same run. The fused kernel moves
fewer bytes, so the figure that compares the two is the time (`speedup` = separate / fused); at
T = 1 the times are launch latency, not bandwidth. Timing: benchmarks/timing.py (CUDA-graph replays
as a decode step runs them, per-call medians, inputs rotating through fresh random sets that
together exceed 2x L2). Correctness first: the fused output against the separate one (the same
arithmetic: codes within one e4m3 step, tests/kernels/test_fp8_producers.py), reported as the fraction of
codes equal.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import (copy_bandwidth_gbps, cuda_run, json_option, parse_positive, print_plan,  # noqa: E402
                    record_bandwidth, replay_options, rotating_sets, time_rotating, try_time, write_json)

from ridge.bench.common import fmt  # noqa: E402

HIDDEN, INTER = 4096, 14336
CASES = ("norm", "silu")
TOKENS = [1, 64, 512, 4096]
ACT = 2                     # bf16 bytes an element


def fp8_bytes(rows: int, k: int) -> int:
    """An activation quantized for the FP8 GEMM: e4m3 values and a float32 scale per 128 channels."""
    return rows * k + 4 * rows * (-(-k // 128))


def case_bytes(case: str, T: int) -> dict:
    """Minimum bytes moved: {"separate": the producer's bf16 output written, read back and quantized,
    "fused": the producer writing the quantized activation}."""
    if case == "norm":
        inputs, k = 3 * T * HIDDEN * ACT + HIDDEN * ACT, HIDDEN       # x, r, the residual out; weight
    elif case == "silu":
        inputs, k = 2 * T * INTER * ACT, INTER
    else:
        raise ValueError(case)
    quantized = fp8_bytes(T, k)
    return {"separate": inputs + 2 * T * k * ACT + quantized, "fused": inputs + quantized}


def cases(args) -> list[dict]:
    return [dict(case=c, T=T, **case_bytes(c, T)) for c in args.only for T in args.tokens]


def make_case(case: str, T: int, g: torch.Generator):
    """(make_set, {variant: fn}); each fn takes a set and returns (e4m3, scales)."""
    from ridge.kernels.fp8_gemm import quantize_act_fp8
    from ridge.kernels.rmsnorm import rms_norm, rms_norm_fp8
    from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_fp8

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    def empty(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="cuda")
    if case == "norm":
        def make_set():
            return dict(x=rnd(T, HIDDEN), r=rnd(T, HIDDEN), w=rnd(HIDDEN, scale=0.3) + 1, out=empty(T, HIDDEN),
                        res_out=empty(T, HIDDEN))
        return make_set, {
            "separate": lambda s: quantize_act_fp8(rms_norm(s["x"], s["w"], 1e-5, s["r"], out=s["out"],
                                                            residual_out=s["res_out"])[0]),
            "fused": lambda s: rms_norm_fp8(s["x"], s["w"], 1e-5, s["r"], residual_out=s["res_out"])[0]}

    def make_set():
        return dict(x=rnd(T, 2 * INTER, scale=4.0), out=empty(T, INTER))
    return make_set, {"separate": lambda s: quantize_act_fp8(silu_and_mul(s["x"], out=s["out"])),
                      "fused": lambda s: silu_and_mul_fp8(s["x"])}


def codes_equal(a, b) -> float:
    """The fraction of e4m3 codes equal (-0 and +0 count as equal) when the scales agree, else 0."""
    (q, s), (rq, rs) = a, b
    if not torch.allclose(s, rs, rtol=1e-6, atol=0):
        return 0.0
    return float((q.float() == rq.float()).float().mean())


def run_case(c: dict, g, copy_gbps: float, args) -> dict:
    make_set, fns = make_case(c["case"], c["T"], g)
    sets = rotating_sets(make_set, sum(t.nbytes for t in make_set().values()))
    res = {**c, "sets": len(sets), "codes_equal": codes_equal(fns["fused"](sets[0]), fns["separate"](sets[0]))}
    for variant, fn in fns.items():
        t = try_time(f"{c['case']} T={c['T']} {variant}",
                     lambda fn=fn: time_rotating(fn, sets, min_calls=args.calls, reps=args.reps))
        record_bandwidth(res, variant, t, c[variant], copy_gbps)
    res["speedup"] = res["separate_us"] / res["fused_us"] if res["separate_us"] and res["fused_us"] else None
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    json_option(ap, "fp8_producers.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--only", choices=CASES, nargs="+", default=list(CASES))
    replay_options(ap)
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    return parse_positive(ap, argv, "tokens")


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = cases(args)
    if args.dry_run:
        return print_plan(plan, lambda c: f"{c['case']:<5} T={c['T']:<5} bytes: separate {c['separate'] / 1e6:8.2f} MB, "
                                          f"fused {c['fused'] / 1e6:8.2f} MB")
    seed, g, _ = cuda_run("fp8_producers.py", "tests/kernels/test_fp8_producers.py")
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seed": seed, "shapes": {"hidden": HIDDEN, "intermediate": INTER},
              "timing": "benchmarks/timing.py: CUDA-graph replays, per-call median, rotating inputs > 2x L2",
              "copy_GBps": copy_bandwidth_gbps(), "cases": []}
    for c in plan:
        print(f"{c['case']} T={c['T']} ...", flush=True)
        result["cases"].append(run_case(c, g, result["copy_GBps"], args))
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, result)

    print(f"\n{result['device']}  copy bandwidth {result['copy_GBps']:.0f} GB/s, seed {seed}; CUDA-graph medians")
    print("MB = minimum bytes moved; frac = (MB / time) / copy bandwidth; speedup = separate / fused time; "
          "eq = fused codes equal to the separate pass's")
    print(f"{'case':<5}{'T':>6} {'sep MB':>8} {'sep us':>8} {'frac':>5} {'fused MB':>8} {'fused us':>8} {'frac':>5} "
          f"{'speedup':>7} {'eq':>7}")
    for r in result["cases"]:
        print(f"{r['case']:<5}{r['T']:>6} {r['separate'] / 1e6:>8.2f} {fmt(r['separate_us'], '.2f'):>8} "
              f"{fmt(r['separate_frac_copy_bw'], '.2f'):>5} {r['fused'] / 1e6:>8.2f} {fmt(r['fused_us'], '.2f'):>8} "
              f"{fmt(r['fused_frac_copy_bw'], '.2f'):>5} {fmt(r['speedup'], '.2f'):>7} {r['codes_equal']:>7.5f}")


if __name__ == "__main__":
    main()
