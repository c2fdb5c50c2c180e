"""GPU benchmark of ridge's fused elementwise/norm kernels against their torch references.

    python benchmarks/kernels/fused_kernels.py [--json PATH] [--tokens 1 64 4096] [--only NAME ...] [--compile]

(JSON defaults to $OUT/fused_kernels.json when OUT is set.) Llama-3-8B shapes, bf16: hidden
4096, intermediate 14336, 32 q / 8 kv heads, head_dim 128. Cases, each at T tokens:

  rmsnorm_residual  (norm(x + r) * w, x + r)   bytes: read x, r; write out, residual; read w
  rmsnorm           norm(x) * w                bytes: read x; write out; read w
  qk_norm           Qwen3 per-head q and k norm on the strided q/k views of a QKV output
  silu_and_mul      [T, 2I] -> [T, I]          bytes: read 2I, write I per token
  rope_kv_write     what the engine runs every layer: rotary on q and k plus the rotated k and v
                    written to T random slots of a paged cache (page 16), one kernel. bytes: read
                    q, k, v, the positions, slots and table half-rows; write q, k and the K/V rows

Minimum bytes are the bytes the operation must move (each input read once, each output
written once); GB/s = minimum bytes / time, and `frac` = that / the device's copy bandwidth,
measured in the same run. Timing: benchmarks/timing.py (CUDA-graph replays as a decode step runs
them, per-call median, inputs rotating through fresh random sets that together exceed 2x L2; at
T = 1 the time is latency, not bandwidth). The torch reference is the peer; --compile adds
torch.compile of the same reference (timed eagerly: it brings graphs of its own). Outputs start
as NaN, so an element the kernel does not write fails the comparison.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import (copy_bandwidth_gbps, json_option, parse_positive, record_bandwidth, replay_options,  # noqa: E402
                    rotating_sets, time_rotating, try_time, write_json)

from ridge.bench.common import fmt  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 4096, 14336, 32, 8, 128, 131072
DT = torch.bfloat16
CASES = ("rmsnorm_residual", "rmsnorm", "qk_norm", "silu_and_mul", "rope_kv_write")
PAGE = 16


def nan(*shape):
    return torch.full(shape, float("nan"), dtype=DT, device="cuda")


def make_case(name: str, T: int, g: torch.Generator, rope):
    """(make_set, ridge fn, reference fn, minimum bytes); the fns take a set and return a tuple of
    output tensors."""
    from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref
    from ridge.kernels.rotary import rope_write_kv, rope_write_kv_ref
    from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(DT)
    e = DT.itemsize
    if name in ("rmsnorm_residual", "rmsnorm"):
        def make_set():
            return dict(x=rnd(T, HIDDEN), r=rnd(T, HIDDEN), w=rnd(HIDDEN, scale=0.3) + 1,
                        out=nan(T, HIDDEN), res_out=nan(T, HIDDEN))
        if name == "rmsnorm":
            return (make_set, lambda s: (rms_norm(s["x"], s["w"], 1e-5, out=s["out"]),),
                    lambda s: (rms_norm_ref(s["x"], s["w"], 1e-5),), (2 * T * HIDDEN + HIDDEN) * e)

        def ref(s):
            t = s["x"] + s["r"]
            return rms_norm_ref(t, s["w"], 1e-5), t
        return (make_set, lambda s: rms_norm(s["x"], s["w"], 1e-5, s["r"], out=s["out"], residual_out=s["res_out"]),
                ref, (4 * T * HIDDEN + HIDDEN) * e)
    if name in ("qk_norm", "rope_kv_write"):
        def views(qkv):
            q = qkv[:, :HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
            k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)
            v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(T, KV_HEADS, HEAD_DIM)
            return q, k, v
        heads_bytes = 2 * T * (HEADS + KV_HEADS) * HEAD_DIM * e       # read and write q and k
        if name == "qk_norm":
            def make_set():
                q, k, _ = views(rnd(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM))
                return dict(q=q, k=k, wq=rnd(HEAD_DIM, scale=0.3) + 1, wk=rnd(HEAD_DIM, scale=0.3) + 1,
                            qo=nan(T, HEADS, HEAD_DIM), ko=nan(T, KV_HEADS, HEAD_DIM))
            return (make_set,
                    lambda s: (rms_norm(s["q"], s["wq"], 1e-6, out=s["qo"]),
                               rms_norm(s["k"], s["wk"], 1e-6, out=s["ko"])),
                    lambda s: (rms_norm_ref(s["q"], s["wq"], 1e-6), rms_norm_ref(s["k"], s["wk"], 1e-6)),
                    heads_bytes + 2 * HEAD_DIM * e)
        pages = -(-T // PAGE)

        def make_set():
            q, k, v = views(rnd(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM))
            # slots 0..T-1 in shuffled order: scattered rows, and the first T rows of each cache
            # are exactly what a call writes, so the outputs compared are the written rows
            caches = [nan(pages, PAGE, KV_HEADS, HEAD_DIM) for _ in range(4)]
            return dict(q=q, k=k, v=v, pos=torch.randint(0, MAX_POS, (T,), generator=g, device="cuda"),
                        slots=torch.randperm(T, generator=g, device="cuda"), caches=caches,
                        rows=[c.view(-1, KV_HEADS, HEAD_DIM)[:T] for c in caches],
                        qo=nan(T, HEADS, HEAD_DIM), ko=nan(T, KV_HEADS, HEAD_DIM))

        def fused(s):
            c = s["caches"]
            rope_write_kv(s["pos"], s["q"], s["k"], s["v"], rope.cos, rope.sin, c[0], c[1], s["slots"],
                          q_out=s["qo"], k_out=s["ko"])
            return s["qo"], s["ko"], s["rows"][0], s["rows"][1]

        def ref(s):
            c = s["caches"]
            return (*rope_write_kv_ref(s["pos"], s["q"], s["k"], s["v"], rope.cos, rope.sin, c[2], c[3], s["slots"]),
                    s["rows"][2], s["rows"][3])
        # positions and table half-rows read; v read, the K/V rows written, the slots read
        table_bytes = T * 8 + T * HEAD_DIM * rope.cos.element_size()
        kv_bytes = 3 * T * KV_HEADS * HEAD_DIM * e + T * 8
        return make_set, fused, ref, heads_bytes + table_bytes + kv_bytes
    if name == "silu_and_mul":
        def make_set():
            return dict(x=rnd(T, 2 * INTER, scale=4.0), out=nan(T, INTER))
        return (make_set, lambda s: (silu_and_mul(s["x"], out=s["out"]),), lambda s: (silu_and_mul_ref(s["x"]),),
                3 * T * INTER * e)
    raise ValueError(name)


def compare(ridge_out, ref_out) -> dict:
    """Bitwise agreement with the reference and the largest difference (rotary differs by design:
    it rounds once from fp32, the reference after every bf16 op). NaN (an unwritten output) counts
    as a difference of infinity."""
    same = sum(int((a == b).sum()) for a, b in zip(ridge_out, ref_out))
    n = sum(a.numel() for a in ridge_out)
    diff = max(float((a.float() - b.float()).abs().nan_to_num(float("inf")).max()) for a, b in zip(ridge_out, ref_out))
    return {"bitwise_equal_frac": same / n, "max_abs_diff": diff}


def run_case(name, T, g, rope, copy_gbps, args) -> dict:
    make_set, ridge_fn, ref_fn, nbytes = make_case(name, T, g, rope)
    sets = rotating_sets(make_set, nbytes)
    res = {"case": name, "T": T, "min_bytes": nbytes, "sets": len(sets), **compare(ridge_fn(sets[0]), ref_fn(sets[0]))}
    peers = {"ridge": (ridge_fn, True), "torch": (ref_fn, True)}
    if args.compile:
        peers["compiled"] = (torch.compile(ref_fn, dynamic=False), False)
    for peer, (fn, graph) in peers.items():
        t = try_time(f"{name} T={T} {peer}", lambda fn=fn, graph=graph: time_rotating(
            fn, sets, min_calls=args.calls, reps=args.reps, graph=graph))
        record_bandwidth(res, peer, t, nbytes, copy_gbps)
    res["speedup_vs_torch"] = res["torch_us"] / res["ridge_us"] if res["ridge_us"] and res["torch_us"] else None
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    json_option(ap, "fused_kernels.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--only", choices=CASES, nargs="+", default=list(CASES))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    replay_options(ap)
    return parse_positive(ap, argv, "tokens")


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/fused_kernels.py needs a CUDA GPU (the kernels' CPU checks are "
                 "tests/kernels/test_fused_kernels.py under TRITON_INTERPRET=1)")
    import triton

    from ridge.layers.rotary import RotaryEmbedding
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device="cuda").manual_seed(seed)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seed": seed, "dtype": str(DT),
              "timing": "benchmarks/timing.py: CUDA-graph replays, per-call median, rotating inputs > 2x L2",
              "shapes": {"hidden": HIDDEN, "intermediate": INTER, "heads": HEADS, "kv_heads": KV_HEADS,
                         "head_dim": HEAD_DIM}}
    result["copy_GBps"] = copy_gbps = copy_bandwidth_gbps()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, scaling).cuda()
    result["cases"] = []
    for name in args.only:
        for T in args.tokens:
            print(f"{name} T={T} ...", flush=True)
            result["cases"].append(run_case(name, T, g, rope, copy_gbps, args))
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, result)

    print(f"\n{result['device']}  copy bandwidth {copy_gbps:.0f} GB/s  bf16, seed {seed}; CUDA-graph replays, medians")
    print("frac = (minimum bytes / time) / copy bandwidth; eq = fraction of outputs bitwise equal to torch")
    head = f"{'case':<17}{'T':>5} {'sets':>5} {'ridge us':>9} {'GB/s':>6} {'frac':>5} {'torch us':>9} {'frac':>5}"
    head += f" {'compiled us':>11} {'frac':>5}" if args.compile else ""
    print(head + f" {'speedup':>7} {'eq':>6}")
    for r in result["cases"]:
        line = (f"{r['case']:<17}{r['T']:>5} {r['sets']:>5} {fmt(r['ridge_us'], '.2f'):>9} "
                f"{fmt(r['ridge_GBps'], '.0f'):>6} {fmt(r['ridge_frac_copy_bw'], '.2f'):>5} "
                f"{fmt(r['torch_us'], '.2f'):>9} {fmt(r['torch_frac_copy_bw'], '.2f'):>5}")
        if args.compile:
            line += f" {fmt(r.get('compiled_us'), '.1f'):>11} {fmt(r.get('compiled_frac_copy_bw'), '.2f'):>5}"
        print(line + f" {fmt(r['speedup_vs_torch'], '.2f'):>7} {r['bitwise_equal_frac']:>6.4f}")


if __name__ == "__main__":
    main()
