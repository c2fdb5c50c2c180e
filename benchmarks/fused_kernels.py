"""GPU benchmark of ridge's fused elementwise/norm kernels against their torch references.

    python benchmarks/fused_kernels.py [--json PATH] [--tokens 1 64 4096] [--only NAME ...] [--compile]

(JSON defaults to $OUT/fused_kernels.json when OUT is set.) Llama-3-8B shapes, bf16: hidden
4096, intermediate 14336, 32 q / 8 kv heads, head_dim 128. Cases, each at T tokens:

  rmsnorm_residual  (norm(x + r) * w, x + r)   bytes: read x, r; write out, residual; read w
  rmsnorm           norm(x) * w                bytes: read x; write out; read w
  qk_norm           Qwen3 per-head q and k norm on the strided q/k views of a QKV output
  silu_and_mul      [T, 2I] -> [T, I]          bytes: read 2I, write I per token
  rope_kv_write     what the engine runs every layer: rotary on q and k plus the rotated k and v
                    written to T random slots of a paged cache (page 16), one kernel. bytes: read
                    q, k, v, the positions, slots and table half-rows; write q, k and the K/V rows.

Minimum bytes are the bytes the operation must move (each input read once, each output
written once); GB/s = minimum bytes / time, and `frac` = that / the device's copy bandwidth,
measured in the same run (a 512 MiB device-to-device copy, bytes read + written / time).
Timings: triton.testing.do_bench medians (a CUDA event pair per rep, L2 flushed before each
rep, so every rep streams from HBM; at T = 1 the time is launch + latency, not bandwidth) after
warm-up, on fresh random inputs (seed printed and saved). The torch reference is the peer;
--compile adds torch.compile of the same reference as a second peer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ridge.bench.common import fmt  # noqa: E402
from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from ridge.kernels.rotary import rope_write_kv, rope_write_kv_ref  # noqa: E402
from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402
from ridge.layers.rotary import RotaryEmbedding  # noqa: E402
from ridge.roofline.ceilings import measure_bandwidth  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 4096, 14336, 32, 8, 128, 131072
DT = torch.bfloat16
CASES = ("rmsnorm_residual", "rmsnorm", "qk_norm", "silu_and_mul", "rope_kv_write")
PAGE = 16


def bench_ms(fn) -> float:
    from triton.testing import do_bench
    fn()  # compile outside the timed region
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s read + written by a large device copy: the roofline's own measurement."""
    return measure_bandwidth(torch.device("cuda"))[0] / 1e9


def bench_graph_ms(fn) -> float:
    """Mean per call of many calls replayed from one CUDA graph (no launch overhead from the host)."""
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100, return_mode="mean")


def make_case(name: str, T: int, g: torch.Generator, rope: RotaryEmbedding):
    """(ridge fn, reference fn, minimum bytes, {other peer: fn}); every fn returns a tuple of
    output tensors."""
    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(DT)
    e = DT.itemsize
    if name in ("rmsnorm_residual", "rmsnorm"):
        x, r, w = rnd(T, HIDDEN), rnd(T, HIDDEN), rnd(HIDDEN, scale=0.3) + 1
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        if name == "rmsnorm":
            return ((lambda: (rms_norm(x, w, 1e-5, out=out),)),
                    (lambda: (rms_norm_ref(x, w, 1e-5),)), (2 * T * HIDDEN + HIDDEN) * e, {})

        def ref():
            s = x + r
            return rms_norm_ref(s, w, 1e-5), s
        return ((lambda: rms_norm(x, w, 1e-5, r, out=out, residual_out=res_out)), ref,
                (4 * T * HIDDEN + HIDDEN) * e, {})
    if name in ("qk_norm", "rope_kv_write"):
        qkv = rnd(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        q = qkv[:, :HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)
        qo, ko = torch.empty(q.shape, dtype=DT, device="cuda"), torch.empty(k.shape, dtype=DT, device="cuda")
        heads_bytes = 2 * T * (HEADS + KV_HEADS) * HEAD_DIM * e       # read and write q and k
        if name == "qk_norm":
            wq, wk = rnd(HEAD_DIM, scale=0.3) + 1, rnd(HEAD_DIM, scale=0.3) + 1
            return ((lambda: (rms_norm(q, wq, 1e-6, out=qo), rms_norm(k, wk, 1e-6, out=ko))),
                    (lambda: (rms_norm_ref(q, wq, 1e-6), rms_norm_ref(k, wk, 1e-6))),
                    heads_bytes + 2 * HEAD_DIM * e, {})
        pos = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
        table_bytes = T * pos.element_size() + T * HEAD_DIM * rope.cos.element_size()
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(T, KV_HEADS, HEAD_DIM)
        # slots 0..T-1 in shuffled order: scattered rows, and `rows` (the first T slots of each
        # cache) is exactly what a call writes, so the outputs compared are the written rows
        slots = torch.randperm(T, generator=g, device="cuda")
        caches = [torch.zeros(-(-T // PAGE), PAGE, KV_HEADS, HEAD_DIM, dtype=DT, device="cuda") for _ in range(4)]
        rows = [c.view(-1, KV_HEADS, HEAD_DIM)[:T] for c in caches]

        def fused():
            rope_write_kv(pos, q, k, v, rope.cos, rope.sin, caches[0], caches[1], slots, q_out=qo, k_out=ko)
            return qo, ko, rows[0], rows[1]

        def ref():
            return (*rope_write_kv_ref(pos, q, k, v, rope.cos, rope.sin, caches[2], caches[3], slots),
                    rows[2], rows[3])
        # + read v, write the K/V rows, read the slots
        kv_bytes = 3 * T * KV_HEADS * HEAD_DIM * e + T * slots.element_size()
        return fused, ref, heads_bytes + table_bytes + kv_bytes, {}
    if name == "silu_and_mul":
        x = rnd(T, 2 * INTER, scale=4.0)
        out = torch.empty(T, INTER, dtype=DT, device="cuda")
        return ((lambda: (silu_and_mul(x, out=out),)), (lambda: (silu_and_mul_ref(x),)), 3 * T * INTER * e, {})
    raise ValueError(name)


def compare(ridge_out, ref_out) -> dict:
    """Bitwise agreement with the reference and the largest difference (rotary differs by design:
    it rounds once from fp32, the reference after every bf16 op)."""
    same = sum(int((a == b).sum()) for a, b in zip(ridge_out, ref_out))
    n = sum(a.numel() for a in ridge_out)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ridge_out, ref_out))
    return {"bitwise_equal_frac": same / n, "max_abs_diff": diff}


def run_case(name, T, g, rope, copy_gbps, use_compile) -> dict:
    ridge_fn, ref_fn, nbytes, others = make_case(name, T, g, rope)
    res = {"case": name, "T": T, "min_bytes": nbytes, **compare(ridge_fn(), ref_fn())}
    for peer, fn in others.items():
        res[f"{peer}_bitwise_equal_frac"] = compare(ridge_fn(), fn())["bitwise_equal_frac"]
    peers = {"ridge": ridge_fn, "torch": ref_fn, **others}
    if use_compile:
        try:
            peers["compiled"] = torch.compile(ref_fn, dynamic=False)
        except Exception as e:  # noqa: BLE001 - a missing peer reports n/a
            print(f"  torch.compile: n/a ({type(e).__name__})")
    for peer, fn in peers.items():
        try:
            ms = bench_ms(fn)
        except Exception as e:  # noqa: BLE001
            print(f"  {name} T={T} {peer}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
            ms = None
        res[f"{peer}_us"] = None if ms is None else ms * 1e3
        res[f"{peer}_GBps"] = None if ms is None else nbytes / (ms * 1e-3) / 1e9
        res[f"{peer}_frac_copy_bw"] = None if ms is None else res[f"{peer}_GBps"] / copy_gbps
    res["speedup_vs_torch"] = res["torch_us"] / res["ridge_us"] if res["ridge_us"] and res["torch_us"] else None
    # a case with a kernel peer is also timed as a decode step runs it: replayed from a CUDA graph
    for peer, fn in ({"ridge": ridge_fn, **others} if others else {}).items():
        try:
            res[f"{peer}_graph_us"] = bench_graph_ms(fn) * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"  {name} T={T} {peer} in a CUDA graph: n/a ({type(e).__name__})")
            res[f"{peer}_graph_us"] = None
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out_dir = os.environ.get("OUT")
    ap.add_argument("--json", default=os.path.join(out_dir, "fused_kernels.json") if out_dir else None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--only", choices=CASES, nargs="+", default=list(CASES))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        ap.error("--tokens must be positive")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fused_kernels.py needs a CUDA GPU (the kernels' CPU checks are "
                 "tests/test_fused_kernels.py under TRITON_INTERPRET=1)")
    import triton
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device="cuda").manual_seed(seed)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seed": seed, "dtype": str(DT),
              "shapes": {"hidden": HIDDEN, "intermediate": INTER, "heads": HEADS, "kv_heads": KV_HEADS,
                         "head_dim": HEAD_DIM}}
    result["copy_GBps"] = copy_gbps = copy_bandwidth()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, scaling).cuda()
    result["cases"] = []
    for name in args.only:
        for T in args.tokens:
            print(f"{name} T={T} ...", flush=True)
            result["cases"].append(run_case(name, T, g, rope, copy_gbps, args.compile))
            torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s  bf16, seed {seed}")
    print("frac = (minimum bytes / time) / copy bandwidth; eq = fraction of outputs bitwise equal to torch")
    head = f"{'case':<17}{'T':>5} {'ridge us':>9} {'GB/s':>6} {'frac':>5} {'torch us':>9} {'GB/s':>6} {'frac':>5}"
    head += f" {'compiled us':>11} {'frac':>5}" if args.compile else ""
    print(head + f" {'speedup':>7} {'eq':>6}")
    for r in result["cases"]:
        line = (f"{r['case']:<17}{r['T']:>5} {fmt(r['ridge_us'], '.1f'):>9} {fmt(r['ridge_GBps'], '.0f'):>6} "
                f"{fmt(r['ridge_frac_copy_bw'], '.2f'):>5} {fmt(r['torch_us'], '.1f'):>9} {fmt(r['torch_GBps'], '.0f'):>6} "
                f"{fmt(r['torch_frac_copy_bw'], '.2f'):>5}")
        if args.compile:
            line += f" {fmt(r.get('compiled_us'), '.1f'):>11} {fmt(r.get('compiled_frac_copy_bw'), '.2f'):>5}"
        print(line + f" {fmt(r['speedup_vs_torch'], '.2f'):>7} {r['bitwise_equal_frac']:>6.4f}")
    fused = [r for r in result["cases"] if "separate_us" in r]
    if fused:
        print("\nfused vs separate kernels (apply_rotary then write_kv); graph = replayed from a CUDA graph; "
              "eq = fraction of outputs bitwise equal to the separate kernels'")
        print(f"{'case':<17}{'T':>5} {'fused us':>9} {'separate us':>11} {'speedup':>7} "
              f"{'graph fused us':>14} {'graph sep us':>12} {'speedup':>7} {'eq':>6}")
        for r in fused:
            sp = r["separate_us"] / r["ridge_us"] if r["separate_us"] and r["ridge_us"] else None
            gsp = (r["separate_graph_us"] / r["ridge_graph_us"]
                   if r.get("separate_graph_us") and r.get("ridge_graph_us") else None)
            print(f"{r['case']:<17}{r['T']:>5} {fmt(r['ridge_us'], '.1f'):>9} {fmt(r['separate_us'], '.1f'):>11} {fmt(sp, '.2f'):>7} "
                  f"{fmt(r.get('ridge_graph_us'), '.2f'):>14} {fmt(r.get('separate_graph_us'), '.2f'):>12} "
                  f"{fmt(gsp, '.2f'):>7} {r['separate_bitwise_equal_frac']:>6.4f}")


if __name__ == "__main__":
    main()
