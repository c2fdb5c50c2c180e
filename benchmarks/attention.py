"""GPU benchmark of ridge's Triton attention kernels against torch's attention backends.

    python benchmarks/attention.py [--json PATH]      (default $OUT/attention.json when OUT is set)

(a) copy bandwidth: a large device-to-device copy, bytes read + written per second;
(b) causal prefill, bf16, 32 heads, hd 128, 16k tokens as B x S = 16x1k, 4x4k, 1x16k: ridge
    (paged cache, page 16, shuffled pages) vs SDPA FlashAttention-2 / cuDNN and FlexAttention on
    contiguous [B, H, S, D]; TFLOP/s with causal FLOPs 4*B*H*S*S*D/2;
(c) decode, bf16, 32 q / 8 kv heads, hd 128, page 16: K+V bytes read / time, as a fraction of
    the copy bandwidth, vs SDPA (default backend) on a contiguous cache. Timed as CUDA-graph
    replays (how the engine runs decode; eager times, which include host launch cost, beside).
All timings: medians (triton.testing.do_bench / do_bench_cudagraph) on fresh random inputs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ridge.bench.common import fmt  # noqa: E402
from ridge.kernels.attention_meta import AttentionMetadata  # noqa: E402
from ridge.kernels.decode_attention import _decode_split_kernel, choose_num_splits, decode_attention  # noqa: E402
from ridge.kernels.prefill_attention import _prefill_kernel, prefill_attention  # noqa: E402
from ridge.roofline.ceilings import measure_bandwidth  # noqa: E402

PAGE, HEAD_DIM, DT = 16, 128, torch.bfloat16


def bench_ms(fn) -> float:
    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph_ms(fn) -> float:
    """Median of CUDA-graph replays: for a kernel shorter than its host-side launch cost (a B=1
    decode step is ~40 us, Python launch of split + merge is comparable), eager timing measures
    the CPU. The engine replays decode steps from CUDA graphs, so this is the number that counts."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def try_peer(name, fn, timer=None):
    try:
        return (timer or bench_ms)(fn)
    except Exception as e:  # a missing backend reports n/a instead of ending the run
        print(f"  {name}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
        return None


def paged_from_contiguous(k, v):
    """[B, kvh, L, D] -> caches [B*L/PAGE, PAGE, kvh, D] on a random page permutation + meta."""
    B, kvh, L, D = k.shape
    P = L // PAGE
    perm = torch.randperm(B * P, device=k.device)
    caches = []
    for t in (k, v):
        c = torch.empty(B * P, PAGE, kvh, D, dtype=t.dtype, device=t.device)
        c[perm] = t.transpose(1, 2).reshape(B * P, PAGE, kvh, D)
        caches.append(c)
    page_tables = perm.view(B, P).to(torch.int32)
    pos = torch.arange(L, device=k.device)
    slots = (page_tables[:, pos // PAGE].long() * PAGE + pos % PAGE).reshape(-1)
    return caches[0], caches[1], page_tables, slots


def make_meta(B, q_len, L, page_tables, slots):
    starts = [i * q_len for i in range(B + 1)]
    dev = page_tables.device
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((B,), L, dtype=torch.int32, device=dev), page_tables=page_tables,
        query_start_loc_cpu=starts, seq_lens_cpu=[L] * B, max_query_len=q_len, max_seq_len=L)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def copy_bandwidth() -> float:
    """GB/s read + written by a large device copy: the roofline's own measurement."""
    return measure_bandwidth(torch.device("cuda"))[0] / 1e9


def bench_prefill(S: int, H: int = 32) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, D = 16384 // S, HEAD_DIM
    q, k, v = (torch.randn(B, H, S, D, dtype=DT, device="cuda") for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    k_cache, v_cache, bt, slots = paged_from_contiguous(k, v)
    meta = make_meta(B, S, S, bt, slots)
    q_flat, k_flat, v_flat = (t.transpose(1, 2).reshape(B * S, H, D).contiguous() for t in (q, k, v))
    out = torch.empty_like(q_flat)
    res = {"B": B, "S": S, "H": H, "D": D}
    flops = 4 * B * H * S * S * D / 2
    tflops = lambda ms: None if ms is None else flops / (ms * 1e-3) / 1e12  # noqa: E731

    res["ridge_ms"] = bench_ms(lambda: prefill_attention(q_flat, k_flat, v_flat, k_cache, v_cache, meta, scale,
                                                                out=out))
    res["best_config"] = str(_prefill_kernel.best_config)
    # correctness on the benchmark inputs: float32 reference for the first and last 128 query rows
    # of the first sequence (the last ones attend to the whole sequence)
    rows = torch.cat([torch.arange(128), torch.arange(S - 128, S)]).cuda()
    s = (q[0][:, rows].float() @ k[0].float().transpose(-1, -2)) * scale
    s.masked_fill_(torch.arange(S, device="cuda")[None, :] > rows[:, None], float("-inf"))
    ref = torch.softmax(s, -1) @ v[0].float()                                # [H, rows, D]
    res["ridge_rel_err"] = rel_err(out[:S][rows].transpose(0, 1), ref)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return run

    res["fa2_ms"] = try_peer("sdpa FLASH_ATTENTION", sdpa(SDPBackend.FLASH_ATTENTION))
    res["cudnn_ms"] = try_peer("sdpa CUDNN_ATTENTION", sdpa(SDPBackend.CUDNN_ATTENTION))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
        flex = torch.compile(flex_attention)
        res["flex_ms"] = try_peer("flex_attention", lambda: flex(q, k, v, block_mask=mask, scale=scale))
    except Exception as e:
        print(f"  flex_attention: n/a ({type(e).__name__})")
        res["flex_ms"] = None
    for name in ("ridge", "fa2", "cudnn", "flex"):
        res[f"{name}_tflops"] = tflops(res[f"{name}_ms"])
    for peer in ("fa2", "cudnn"):
        res[f"ridge_over_{peer}"] = (res["ridge_tflops"] / res[f"{peer}_tflops"]
                                     if res[f"{peer}_tflops"] else None)
    return res


def bench_decode(B: int, L: int, copy_gbps: float, H: int = 32, KVH: int = 8, sweep=()) -> dict:
    D = HEAD_DIM
    k, v = (torch.randn(B, KVH, L, D, dtype=DT, device="cuda") for _ in range(2))
    q = torch.randn(B, H, D, dtype=DT, device="cuda")
    scale = 1.0 / math.sqrt(D)
    k_cache, v_cache, bt, slots = paged_from_contiguous(k, v)
    meta = make_meta(B, 1, L, bt, slots.view(B, L)[:, -1])  # the one new token per sequence
    out = torch.empty_like(q)
    kv_bytes = 2 * B * L * KVH * D * k.element_size()
    res = {"B": B, "L": L, "H": H, "KVH": KVH, "D": D, "kv_bytes": kv_bytes,
           "num_splits": choose_num_splits(B, KVH, L, q.device)}
    run = lambda: decode_attention(q, k_cache, v_cache, meta, scale, out=out)  # noqa: E731
    res["ridge_eager_ms"] = bench_ms(run)
    res["best_config"] = str(_decode_split_kernel.best_config)  # the autotuner's pick for this shape
    res["ridge_ms"] = bench_graph_ms(run)
    res["ridge_ms_again"] = bench_graph_ms(run)
    # the split count is the decode kernel's main lever: time a few around the heuristic's choice
    frac = lambda ms: kv_bytes / (ms * 1e-3) / 1e9 / copy_gbps  # noqa: E731
    res["splits_sweep"] = {}
    for s in sweep:
        at_s = lambda: decode_attention(q, k_cache, v_cache, meta, scale, out=out, num_splits=s)  # noqa: E731
        res["splits_sweep"][s] = {"frac": frac(bench_graph_ms(at_s))}
    qg = q.view(B, KVH, H // KVH, D).float()
    ref = torch.empty(B, KVH, H // KVH, D, device="cuda")
    for b in range(B):  # float32 reference, one sequence at a time to bound memory
        p = torch.softmax(qg[b] @ k[b].float().transpose(-1, -2) * scale, -1)
        ref[b] = p @ v[b].float()
    res["ridge_rel_err"] = rel_err(out.view(B, KVH, H // KVH, D), ref)
    q4 = q.view(B, H, 1, D)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    res["sdpa_eager_ms"] = try_peer("sdpa decode", sdpa)
    res["sdpa_ms"] = try_peer("sdpa decode (graph)", sdpa, bench_graph_ms)
    for name in ("ridge", "sdpa"):
        ms = res.get(f"{name}_ms")
        res[f"{name}_GBps"] = None if ms is None else kv_bytes / (ms * 1e-3) / 1e9
        res[f"{name}_frac_copy_bw"] = None if ms is None else res[f"{name}_GBps"] / copy_gbps
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out_dir = os.environ.get("OUT")
    ap.add_argument("--json", default=os.path.join(out_dir, "attention.json") if out_dir else None)
    ap.add_argument("--only", choices=["prefill", "decode"], default=None)
    ap.add_argument("--splits-sweep", type=int, nargs="*", default=[],
                    help="also time the decode kernel at these split counts (fraction of copy bandwidth)")
    ap.add_argument("--sweep-b1-only", action="store_true", help="apply --splits-sweep to the B=1 shape only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__}
    copy_gbps = copy_bandwidth()
    result["copy_GBps"] = copy_gbps
    result["prefill"] = []
    for S in (1024, 4096, 16384) if args.only != "decode" else ():
        print(f"prefill S={S} ...", flush=True)
        result["prefill"].append(bench_prefill(S))
        torch.cuda.empty_cache()
    result["decode"] = []
    for B, L in ((1, 32768), (32, 4096), (128, 2048)) if args.only != "prefill" else ():
        print(f"decode B={B} L={L} ...", flush=True)
        sweep = args.splits_sweep if (B == 1 or not args.sweep_b1_only) else ()
        result["decode"].append(bench_decode(B, L, copy_gbps, sweep=sweep))
        torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s")
    print("prefill causal bf16, H=32, D=128           TFLOP/s                      ratio ridge/")
    print(f"{'B':>4} {'S':>6} {'ridge':>7} {'FA2':>7} {'cuDNN':>7} {'flex':>7} {'FA2':>6} {'cuDNN':>6} {'rel_err':>9}")
    for r in result["prefill"]:
        print(f"{r['B']:>4} {r['S']:>6} {fmt(r['ridge_tflops'], '.1f'):>7} {fmt(r['fa2_tflops'], '.1f'):>7} "
              f"{fmt(r['cudnn_tflops'], '.1f'):>7} {fmt(r['flex_tflops'], '.1f'):>7} "
              f"{fmt(r['ridge_over_fa2'], '.2f'):>6} {fmt(r['ridge_over_cudnn'], '.2f'):>6} "
              f"{r['ridge_rel_err']:>9.2e}")
        print(f"      autotune pick: {r['best_config']}")
    print("decode bf16, 32 q / 8 kv heads, D=128, page 16, CUDA-graph replays   (GB/s, fraction of copy bandwidth)")
    print(f"{'B':>4} {'L':>6} {'splits':>6} {'ridge us':>9} {'GB/s':>6} {'frac':>5} "
          f"{'sdpa us':>8} {'GB/s':>6} {'frac':>5} {'rel_err':>9}")
    for r in result["decode"]:
        sdpa_us = None if r["sdpa_ms"] is None else r["sdpa_ms"] * 1e3
        print(f"      autotune pick: {r['best_config']}; graph timed again: {r['ridge_ms_again'] * 1e3:.1f} us; "
              f"eager: ridge {r['ridge_eager_ms'] * 1e3:.1f} us, sdpa {fmt(r['sdpa_eager_ms'] and r['sdpa_eager_ms'] * 1e3, '.1f')} us")
        print(f"{r['B']:>4} {r['L']:>6} {r['num_splits']:>6} {r['ridge_ms'] * 1e3:>9.1f} "
              f"{fmt(r['ridge_GBps'], '.0f'):>6} {fmt(r['ridge_frac_copy_bw'], '.2f'):>5} "
              f"{fmt(sdpa_us, '.1f'):>8} {fmt(r['sdpa_GBps'], '.0f'):>6} "
              f"{fmt(r['sdpa_frac_copy_bw'], '.2f'):>5} {r['ridge_rel_err']:>9.2e}")
        if r["splits_sweep"]:
            print("      splits -> frac of copy bw: " + "  ".join(
                f"{s}:{w['frac']:.2f}" for s, w in r["splits_sweep"].items()))


if __name__ == "__main__":
    main()
