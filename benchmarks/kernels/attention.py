"""GPU benchmark of ridge's Triton attention kernels against torch's attention backends.

    python benchmarks/kernels/attention.py [--json PATH] [--only prefill|decode] [--splits-sweep 32 64 128]
        [--kv-cache-dtype bf16|fp8|both] [--decode-shapes 32x4096 128x2048]
    (JSON defaults to $OUT/attention.json when OUT is set)

(a) the ceiling: the device's copy bandwidth (ridge.roofline's measurement: a large device copy,
    bytes read + written per second), measured in the same run;
(b) causal prefill, bf16, 32 heads, hd 128, 16k tokens as B x S = 16x1k, 4x4k, 1x16k: ridge
    (paged cache, page 16, shuffled pages) vs SDPA FlashAttention-2 / cuDNN and FlexAttention on
    contiguous [B, H, S, D]; TFLOP/s with causal FLOPs 4*B*H*S*S*D/2;
(c) decode, bf16, 32 q / 8 kv heads, hd 128, page 16: K+V bytes read / time, as a fraction of
    the copy bandwidth, vs SDPA (default backend) on a contiguous cache; --splits-sweep also
    times the decode kernel at the given split counts;
(d) --kv-cache-dtype fp8|both: decode also over an FP8 cache (ridge/kernels/kv_fp8.py: e4m3 rows
    plus one scale byte, D + 1 bytes per row) at the same shapes: its time, its ratio to the bf16
    kernel's time in the same run (the target: <= 0.55 at B=32 L=4096 and B=128 L=2048, which are
    then always timed), its bytes / time as a fraction of the copy bandwidth, and its error both
    against the unquantized bf16 K/V (quantization) and against its own dequantized cache (kernel).
    fp8 times the bf16 kernel as its peer only; both also keeps the SDPA peer and the repeat run.
    Prefill is unaffected: a prefill without a cached prefix does not read the cache.
Timing: benchmarks/timing.py (CUDA-graph replays, per-call median, inputs rotating through sets
that together exceed 2x L2, fresh random values); FlexAttention, compiled by torch.compile with
graphs of its own, is timed eagerly between the same events. The table comes last.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import copy_bandwidth_gbps, json_option, rotating_sets, time_rotating, try_time, write_json  # noqa: E402

from ridge.bench.common import fmt  # noqa: E402

PAGE, HEAD_DIM, DT = 16, 128, torch.bfloat16
PREFILL_SHAPES = (1024, 4096, 16384)                 # S; B = 16384 // S
DECODE_SHAPES = ((1, 32768), (32, 4096), (128, 2048))   # (B, L)
FP8_TARGET_SHAPES, FP8_TARGET_RATIO = ((32, 4096), (128, 2048)), 0.55   # fp8 time / bf16 time


def paged_from_contiguous(k, v, *more):
    """[B, kvh, L, ...] tensors (k, v, then e.g. FP8 rows and their scales [B, kvh, L]) -> caches
    [B*L/PAGE, PAGE, kvh, ...] on one random page permutation, + page tables and slots."""
    B, kvh, L = k.shape[:3]
    P = L // PAGE
    perm = torch.randperm(B * P, device=k.device)
    caches = []
    for t in (k, v, *more):
        src = t.transpose(1, 2).reshape(B * P, PAGE, kvh, *t.shape[3:])
        c = torch.empty_like(src)
        c.view(torch.uint8)[perm] = src.view(torch.uint8)   # as bytes: float8 has no index_put
        caches.append(c)
    page_tables = perm.view(B, P).to(torch.int32)
    pos = torch.arange(L, device=k.device)
    slots = (page_tables[:, pos // PAGE].long() * PAGE + pos % PAGE).reshape(-1)
    return (*caches, page_tables, slots)


def make_meta(B, q_len, L, page_tables, slots):
    from ridge.kernels.attention_meta import AttentionMetadata
    starts = [i * q_len for i in range(B + 1)]
    dev = page_tables.device
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((B,), L, dtype=torch.int32, device=dev), page_tables=page_tables,
        query_start_loc_cpu=starts, seq_lens_cpu=[L] * B, max_query_len=q_len, max_seq_len=L)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_prefill(S: int, args, H: int = 32) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ridge.kernels.prefill_attention import _prefill_kernel, prefill_attention
    B, D = 16384 // S, HEAD_DIM
    scale = 1.0 / math.sqrt(D)

    def make_set():
        q, k, v = (torch.randn(B, H, S, D, dtype=DT, device="cuda") for _ in range(3))
        k_cache, v_cache, bt, slots = paged_from_contiguous(k, v)
        flat = [t.transpose(1, 2).reshape(B * S, H, D).contiguous() for t in (q, k, v)]
        return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, meta=make_meta(B, S, S, bt, slots),
                    flat=flat, out=torch.empty_like(flat[0]))
    sets = rotating_sets(make_set, 6 * B * H * S * D * DT.itemsize)     # q, k, v, both caches, out
    flops = 4 * B * H * S * S * D / 2
    res = {"B": B, "S": S, "H": H, "D": D, "sets": len(sets)}

    def ridge(s):
        q, k, v = s["flat"]
        return prefill_attention(q, k, v, s["k_cache"], s["v_cache"], s["meta"], scale, out=s["out"])

    def sdpa(backend):
        def run(s):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=True,
                                                                         scale=scale)
        return run

    opts = dict(min_calls=args.prefill_calls, reps=args.prefill_reps)
    timings = {"ridge": try_time("ridge prefill", lambda: time_rotating(ridge, sets, **opts)),
               "fa2": try_time("sdpa FLASH_ATTENTION", lambda: time_rotating(sdpa(SDPBackend.FLASH_ATTENTION),
                                                                           sets, **opts)),
               "cudnn": try_time("sdpa CUDNN_ATTENTION", lambda: time_rotating(sdpa(SDPBackend.CUDNN_ATTENTION),
                                                                             sets, **opts))}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
        flex = torch.compile(flex_attention)
        timings["flex"] = try_time("flex_attention", lambda: time_rotating(
            lambda s: flex(s["q"], s["k"], s["v"], block_mask=mask, scale=scale), sets, graph=False, **opts))
    except Exception as e:  # noqa: BLE001 - a missing peer reports n/a
        print(f"  flex_attention: n/a ({type(e).__name__})")
        timings["flex"] = None
    res["best_config"] = str(getattr(_prefill_kernel, "best_config", None))
    # correctness on the benchmark inputs: float32 reference for the first and last 128 query rows
    # of the first sequence (the last ones attend to the whole sequence)
    s0 = sets[0]
    ridge(s0)
    q, k, v = s0["q"], s0["k"], s0["v"]
    rows = torch.cat([torch.arange(128), torch.arange(S - 128, S)]).cuda()
    sc = (q[0][:, rows].float() @ k[0].float().transpose(-1, -2)) * scale
    sc.masked_fill_(torch.arange(S, device="cuda")[None, :] > rows[:, None], float("-inf"))
    ref = torch.softmax(sc, -1) @ v[0].float()                                # [H, rows, D]
    res["ridge_rel_err"] = rel_err(s0["out"][:S][rows].transpose(0, 1), ref)
    for name, t in timings.items():
        res[f"{name}_timing"] = t and t.as_dict()
        res[f"{name}_us"] = t and t.median_us
        res[f"{name}_tflops"] = t and flops / (t.median_us * 1e-6) / 1e12
    for peer in ("fa2", "cudnn", "flex"):
        res[f"ridge_over_{peer}"] = (res["ridge_tflops"] / res[f"{peer}_tflops"]
                                     if res["ridge_tflops"] and res[f"{peer}_tflops"] else None)
    return res


def bench_decode(B: int, L: int, copy_gbps: float, args, sweep=(), H: int = 32, KVH: int = 8) -> dict:
    from ridge.kernels.decode_attention import _decode_split_kernel, choose_num_splits, decode_attention
    from ridge.kernels.kv_fp8 import dequantize_rows_ref, quantize_rows_ref
    D = HEAD_DIM
    scale = 1.0 / math.sqrt(D)
    fp8 = args.kv_cache_dtype != "bf16"
    peers = args.kv_cache_dtype != "fp8"      # fp8 alone: the bf16 kernel is the only peer

    def make_set():
        k, v = (torch.randn(B, KVH, L, D, dtype=DT, device="cuda") for _ in range(2))
        q = torch.randn(B, H, D, dtype=DT, device="cuda")
        quantized = (*quantize_rows_ref(k), *quantize_rows_ref(v)) if fp8 else ()
        k_cache, v_cache, *fp8_cache, bt, slots = paged_from_contiguous(k, v, *quantized)
        meta = make_meta(B, 1, L, bt, slots.view(B, L)[:, -1])  # the one new token per sequence
        return dict(q=q, k=k, v=v, q4=q.view(B, H, 1, D), k_cache=k_cache, v_cache=v_cache, meta=meta,
                    out=torch.empty_like(q), fp8_cache=fp8_cache)   # fp8: k8, k_scale, v8, v_scale
    kv_bytes = 2 * B * L * KVH * D * DT.itemsize
    fp8_bytes = 2 * B * L * KVH * (D + 1)                  # e4m3 rows + one e8m0 byte each
    sets = rotating_sets(make_set, 2 * kv_bytes + fp8 * fp8_bytes)   # paged, contiguous, fp8 caches
    res = {"B": B, "L": L, "H": H, "KVH": KVH, "D": D, "kv_bytes": kv_bytes, "sets": len(sets),
           "num_splits": choose_num_splits(B, KVH, L, torch.device("cuda"))}
    opts = dict(min_calls=args.decode_calls, reps=args.decode_reps)

    def ridge(s, num_splits=None):
        return decode_attention(s["q"], s["k_cache"], s["v_cache"], s["meta"], scale, out=s["out"],
                                num_splits=num_splits)

    def sdpa(s):
        return torch.nn.functional.scaled_dot_product_attention(s["q4"], s["k"], s["v"], scale=scale,
                                                                 enable_gqa=True)
    def ridge_fp8(s):
        k8, ks, v8, vs = s["fp8_cache"]
        return decode_attention(s["q"], k8, v8, s["meta"], scale, out=s["out"], kv_scales=(ks, vs))
    frac = lambda t: t and kv_bytes / (t.median_us * 1e-6) / 1e9 / copy_gbps  # noqa: E731
    timings = {"ridge": try_time("ridge decode", lambda: time_rotating(ridge, sets, **opts))}
    for name, label, fn in (("ridge_again", "ridge decode", ridge), ("sdpa", "sdpa decode", sdpa)):
        timings[name] = try_time(label, lambda fn=fn: time_rotating(fn, sets, **opts)) if peers else None
    res["best_config"] = str(getattr(_decode_split_kernel, "best_config", None))
    if fp8:
        t = try_time("ridge decode, fp8 cache", lambda: time_rotating(ridge_fp8, sets, **opts))
        res["fp8_best_config"] = str(getattr(_decode_split_kernel, "best_config", None))
        res.update(fp8_bytes=fp8_bytes, fp8_timing=t and t.as_dict(), fp8_us=t and t.median_us,
                   fp8_GBps=t and fp8_bytes / (t.median_us * 1e-6) / 1e9)
        res["fp8_frac_copy_bw"] = t and res["fp8_GBps"] / copy_gbps
        res["fp8_over_bf16"] = t and timings["ridge"] and t.median_us / timings["ridge"].median_us
        res["fp8_target"] = ({"max_ratio": FP8_TARGET_RATIO, "met": res["fp8_over_bf16"] is not None
                              and res["fp8_over_bf16"] <= FP8_TARGET_RATIO} if (B, L) in FP8_TARGET_SHAPES else None)
    res["splits_sweep"] = {}
    for n in sweep:
        t = try_time(f"ridge decode splits={n}", lambda n=n: time_rotating(lambda s: ridge(s, n), sets, **opts))
        res["splits_sweep"][n] = {"us": t and t.median_us, "frac": frac(t)}
    s0 = sets[0]
    qg = s0["q"].view(B, KVH, H // KVH, D).float()
    attend = lambda b, k, v: torch.softmax(qg[b] @ k.float().transpose(-1, -2) * scale, -1) @ v.float()  # noqa: E731
    ref = torch.empty(B, KVH, H // KVH, D, device="cuda")
    for b in range(B):  # float32 reference, one sequence at a time to bound memory
        ref[b] = attend(b, s0["k"][b], s0["v"][b])
    ridge(s0)
    res["ridge_rel_err"] = rel_err(s0["out"].view(B, KVH, H // KVH, D), ref)
    if fp8:   # quantization error (vs the bf16 K/V) and kernel error (vs the dequantized cache)
        ridge_fp8(s0)
        out = s0["out"].view(B, KVH, H // KVH, D)
        res["fp8_rel_err"] = rel_err(out, ref)
        deq = lambda x: dequantize_rows_ref(*quantize_rows_ref(x), torch.float32)  # noqa: E731
        for b in range(B):
            ref[b] = attend(b, deq(s0["k"][b]), deq(s0["v"][b]))
        res["fp8_kernel_rel_err"] = rel_err(out, ref)
    for name, t in timings.items():
        res[f"{name}_timing"] = t and t.as_dict()
        res[f"{name}_us"] = t and t.median_us
        res[f"{name}_GBps"] = t and kv_bytes / (t.median_us * 1e-6) / 1e9
        res[f"{name}_frac_copy_bw"] = frac(t)
    res["ridge_over_sdpa"] = (res["sdpa_us"] / res["ridge_us"]) if res["ridge_us"] and res["sdpa_us"] else None
    return res


def decode_shape(text: str) -> tuple[int, int]:
    """'BxL' -> (B, L); L a multiple of the page (the benchmark's caches hold whole pages)."""
    try:
        b, l_ = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"decode shape {text!r}: expected BxL, e.g. 32x4096") from None
    if b < 1 or l_ < PAGE or l_ % PAGE:
        raise argparse.ArgumentTypeError(f"decode shape {text!r}: B >= 1 and L a multiple of {PAGE}")
    return b, l_


def decode_plan(args) -> list[tuple[int, int]]:
    """The decode shapes to time: --decode-shapes (or the defaults), plus the FP8 target shapes
    whenever the FP8 cache is timed, so the target is always checked."""
    shapes = list(args.decode_shapes or DECODE_SHAPES)
    if args.kv_cache_dtype != "bf16":
        shapes += [s for s in FP8_TARGET_SHAPES if s not in shapes]
    return shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    json_option(ap, "attention.json")
    ap.add_argument("--only", choices=["prefill", "decode"], default=None)
    ap.add_argument("--splits-sweep", type=int, nargs="*", default=[],
                    help="also time the decode kernel at these split counts (fraction of copy bandwidth)")
    ap.add_argument("--sweep-b1-only", action="store_true", help="apply --splits-sweep to the B=1 shape only")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8", "both"], default="bf16",
                    help="fp8: also time decode over an FP8 cache, the bf16 kernel its only peer; both: "
                         "with the SDPA peer too")
    ap.add_argument("--decode-shapes", type=decode_shape, nargs="+", default=None, metavar="BxL",
                    help="decode shapes (default: " + " ".join(f"{b}x{n}" for b, n in DECODE_SHAPES) + ")")
    ap.add_argument("--prefill-calls", type=int, default=4, help="prefill calls per graph (at least)")
    ap.add_argument("--prefill-reps", type=int, default=10, help="timed prefill replays (median)")
    ap.add_argument("--decode-calls", type=int, default=20, help="decode calls per graph (at least)")
    ap.add_argument("--decode-reps", type=int, default=30, help="timed decode replays (median)")
    args = ap.parse_args(argv)
    if min(args.prefill_calls, args.prefill_reps, args.decode_calls, args.decode_reps) < 1:
        ap.error("--*-calls and --*-reps must be positive")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/attention.py needs a CUDA GPU (the kernels' CPU checks are "
                 "tests/kernels/test_attention_kernels.py under TRITON_INTERPRET=1)")
    import triton
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "timing": "benchmarks/timing.py: CUDA-graph replays, per-call median, rotating inputs > 2x L2",
              "kv_cache_dtype": args.kv_cache_dtype}
    copy_gbps = result["copy_GBps"] = copy_bandwidth_gbps()
    result["prefill"], result["decode"] = [], []
    for S in PREFILL_SHAPES if args.only != "decode" else ():
        print(f"prefill S={S} ...", flush=True)
        result["prefill"].append(bench_prefill(S, args))
        torch.cuda.empty_cache()
    for B, L in decode_plan(args) if args.only != "prefill" else ():
        print(f"decode B={B} L={L} ...", flush=True)
        sweep = args.splits_sweep if (B == 1 or not args.sweep_b1_only) else ()
        result["decode"].append(bench_decode(B, L, copy_gbps, args, sweep=sweep))
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, result)

    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s; CUDA-graph replays, medians")
    if result["prefill"]:
        print("prefill causal bf16, H=32, D=128           TFLOP/s                      ratio ridge/")
        print(f"{'B':>4} {'S':>6} {'ridge':>7} {'FA2':>7} {'cuDNN':>7} {'flex':>7} {'FA2':>6} {'cuDNN':>6} "
              f"{'flex':>6} {'rel_err':>9}")
        for r in result["prefill"]:
            print(f"{r['B']:>4} {r['S']:>6} {fmt(r['ridge_tflops'], '.1f'):>7} {fmt(r['fa2_tflops'], '.1f'):>7} "
                  f"{fmt(r['cudnn_tflops'], '.1f'):>7} {fmt(r['flex_tflops'], '.1f'):>7} "
                  f"{fmt(r['ridge_over_fa2'], '.2f'):>6} {fmt(r['ridge_over_cudnn'], '.2f'):>6} "
                  f"{fmt(r['ridge_over_flex'], '.2f'):>6} {r['ridge_rel_err']:>9.2e}")
    if result["decode"]:
        print("decode bf16, 32 q / 8 kv heads, D=128, page 16   (frac = K+V bytes / time / copy bandwidth)")
        print(f"{'B':>4} {'L':>6} {'splits':>6} {'ridge us':>9} {'frac':>5} {'again us':>9} {'sdpa us':>8} "
              f"{'frac':>5} {'sdpa/ridge':>10} {'rel_err':>9}")
        for r in result["decode"]:
            print(f"{r['B']:>4} {r['L']:>6} {r['num_splits']:>6} {fmt(r['ridge_us'], '.1f'):>9} "
                  f"{fmt(r['ridge_frac_copy_bw'], '.2f'):>5} {fmt(r['ridge_again_us'], '.1f'):>9} "
                  f"{fmt(r['sdpa_us'], '.1f'):>8} {fmt(r['sdpa_frac_copy_bw'], '.2f'):>5} "
                  f"{fmt(r['ridge_over_sdpa'], '.2f'):>10} {r['ridge_rel_err']:>9.2e}")
            if r["splits_sweep"]:
                print("      splits -> frac of copy bw: " + "  ".join(
                    f"{n}:{fmt(w['frac'], '.2f')}" for n, w in r["splits_sweep"].items()))
    fp8_rows = [r for r in result["decode"] if "fp8_us" in r]
    if fp8_rows:
        print(f"decode FP8 cache (frac = (D+1)-byte rows / time / copy bandwidth; target fp8/bf16 <= "
              f"{FP8_TARGET_RATIO} at " + ", ".join(f"B={b} L={n}" for b, n in FP8_TARGET_SHAPES) + ")")
        print(f"{'B':>4} {'L':>6} {'bf16 us':>8} {'fp8 us':>8} {'frac':>5} {'fp8/bf16':>8} {'target':>6} "
              f"{'err vs bf16':>11} {'kernel err':>10}")
        for r in fp8_rows:
            met = "n/a" if r["fp8_target"] is None else ("met" if r["fp8_target"]["met"] else "MISSED")
            print(f"{r['B']:>4} {r['L']:>6} {fmt(r['ridge_us'], '.1f'):>8} {fmt(r['fp8_us'], '.1f'):>8} "
                  f"{fmt(r['fp8_frac_copy_bw'], '.2f'):>5} {fmt(r['fp8_over_bf16'], '.3f'):>8} {met:>6} "
                  f"{r['fp8_rel_err']:>11.2e} {r['fp8_kernel_rel_err']:>10.2e}")


if __name__ == "__main__":
    main()
