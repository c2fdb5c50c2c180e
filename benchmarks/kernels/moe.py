"""Mixture-of-experts benchmarks (issue 18), two parts; JSON to --json, a table last.

  kernels  one MoE layer's experts at the Qwen3-30B-A3B shape (128 experts, top-8, H 2048, I 768)
           and the Mixtral-8x7B shape (8 experts, top-2, H 4096, I 14336), bf16, over token counts
           1..4096: ridge's layer (routing + the path and tiles its plan measured fastest, replayed
           from a CUDA graph; the plan is measured in this run and written out) against the torch
           reference (the per-expert loop HF runs, eager) and against cuBLAS doing the same FLOPs
           as two batched GEMMs over the selected experts with the rows spread evenly (torch.bmm:
           the balanced-load ideal a grouped GEMM is held to). Per row: time, bytes of the distinct
           experts touched and their fraction of the measured copy bandwidth (MBU), TFLOP/s and
           their fraction of the measured bf16 matrix roof; and the grouped GEMM alone (gate/up +
           down with the top-k sum fused, alignment excluded) at 4096 routed pairs and at 4096 tokens.
  e2e      the engine on a config-only checkpoint with --load-format dummy (e.g. the Qwen3-30B-A3B
           shape from `python -m ridge.utils.random_checkpoint DIR --arch qwen3moe --preset
           qwen3-30b-a3b --config-only`): decode tokens/s and MBU (all bytes) and the MBU of the
           weights alone at each --batches, from `ridge bench latency`'s run_latency; then (with
           --hf) HF transformers on the same config with random weights in the same run: greedy
           generate, decode rate = (new tokens - 1) / (t(new tokens) - t(1 token)).

    python benchmarks/kernels/moe.py kernels --json moe_kernels.json
    python benchmarks/kernels/moe.py e2e --model /tmp/qwen3-30b-a3b --batches 1 64 256 --hf --json moe_e2e.json
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import time_calls, try_time  # noqa: E402

from ridge.bench.common import device_name, format_table, write_json  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768, renormalize=True),
          "mixtral-8x7b": dict(E=8, k=2, H=4096, I=14336, renormalize=True)}
TOKENS = (1, 2, 4, 8, 16, 64, 256, 512, 1024, 4096)


def kernels(a) -> dict:
    from ridge.utils.ceilings import load_ceilings

    ceil = load_ceilings("cuda")
    bw, roof = ceil.bandwidth, ceil.peak("bf16")
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    out = dict(device=device_name(torch.device("cuda")), bandwidth=bw, bf16_roof=roof, shapes={})
    for name in a.shapes:
        out["shapes"][name] = kernel_shape(a, SHAPES[name], name, gen, bw, roof)
        gc.collect()
        torch.cuda.empty_cache()
    return out


def kernel_shape(a, s: dict, name: str, gen, bw: float, roof: float) -> dict:
    from ridge.kernels.moe_gemm import grouped_gemm
    from ridge.kernels.moe_route import align_by_expert
    from ridge.layers.moe import FusedMoE
    from ridge.layers.moe_tuning import BUCKETS

    E, k, H, inter = s["E"], s["k"], s["H"], s["I"]
    with torch.device("cuda"):
        moe = FusedMoE(E, k, H, inter, s["renormalize"]).to(torch.bfloat16)
    for w in (moe.w13_weight, moe.w2_weight):
        w.normal_(0.0, 0.02, generator=gen)
    t0 = time.perf_counter()
    moe.finish_loading()                      # measures (or reads) the plan
    plan_s = time.perf_counter() - t0
    expert_bytes = 3 * H * inter * 2
    rows = []
    for T in a.tokens:
        sets = [dict(x=torch.randn(T, H, device="cuda", generator=gen).bfloat16(),
                     logits=torch.randn(T, E, device="cuda", generator=gen).bfloat16()) for _ in range(4)]
        ridge = time_calls([lambda s=s: moe(s["logits"], s["x"]) for s in sets * 5], sets=4, reps=10)
        experts = [torch.topk(torch.softmax(st["logits"].float(), -1), k).indices for st in sets]
        distinct = statistics.mean(len(torch.unique(e)) for e in experts)
        P, flops = T * k, 2 * T * k * 3 * H * inter
        ref = try_time("reference", lambda: time_calls([lambda s=s: moe_ref(moe, s) for s in sets], sets=4, reps=5,
                                                       graph=False))
        per = -(-P // max(1, int(distinct)))
        xa = torch.randn(int(distinct), per, H, device="cuda", generator=gen).bfloat16()
        ha = torch.randn(int(distinct), per, inter, device="cuda", generator=gen).bfloat16()
        w13a, w2a = moe.w13_weight[:int(distinct)], moe.w2_weight[:int(distinct)]
        cublas = try_time("cublas", lambda: time_calls(
            [lambda: (torch.bmm(xa, w13a.transpose(1, 2)), torch.bmm(ha, w2a.transpose(1, 2)))] * 10, reps=10))
        sec = ridge.median_us * 1e-6
        path, tiles = moe.plan.choice(T)
        rows.append(dict(tokens=T, pairs=P, path=path, tiles=[list(t) for t in tiles], ridge_us=ridge.median_us,
                         reference_us=ref.median_us if ref else None, cublas_bmm_us=cublas.median_us if cublas else None,
                         distinct_experts=distinct, active_bytes=distinct * expert_bytes,
                         mbu=distinct * expert_bytes / sec / bw, tflops=flops / sec / 1e12, mfu=flops / sec / roof))
        print(f"  {name} T={T}: {ridge.median_us:.1f} us ({path}), MBU {rows[-1]['mbu']:.1%}, "
              f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    grouped = []
    for T in sorted({max(1, 4096 // k), 4096}):
        path, tiles = moe.plan.choice(T)
        gu, dn = moe.plan.table[BUCKETS[-1]][1] if path == "small" else tiles
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        experts = torch.rand(T, E, device="cuda", generator=gen).topk(k, -1).indices.int()
        weights = torch.rand(T, k, device="cuda", generator=gen)
        hidden = torch.randn(T * k, inter, device="cuda", generator=gen).bfloat16()
        layout = align_by_expert(experts, E, gu.block_m)
        t = time_calls([lambda: (grouped_gemm(x, moe.w13_weight, layout, T * k, k, gu, gated=True),
                                 grouped_gemm(hidden, moe.w2_weight, layout, T * k, 1, dn,
                                              route_weights=weights))] * 5, reps=10)
        flops = 2 * T * k * 3 * H * inter
        counts = torch.bincount(experts.view(-1).long(), minlength=E)
        intensity = flops / (int((counts > 0).sum()) * expert_bytes + T * k * (3 * H + 2 * inter) * 2 + T * H * 2)
        grouped.append(dict(tokens=T, pairs=T * k, us=t.median_us, tflops=flops / t.median_us / 1e6,
                            fraction_of_roof=flops / (t.median_us * 1e-6) / roof, intensity_flop_per_byte=intensity,
                            attainable_fraction=min(1.0, intensity * bw / roof), max_tokens_per_expert=int(counts.max()),
                            mean_tokens_per_expert=T * k / E))
        print(f"  {name} grouped GEMM, {T * k} pairs: {grouped[-1]['tflops']:.0f} TFLOP/s = "
              f"{grouped[-1]['fraction_of_roof']:.1%} of the bf16 roof", flush=True)
    return dict(shape=s, plan_seconds=plan_s, rows=rows, grouped=grouped,
                plan={str(b): [p, [list(t) for t in ts]] for b, (p, ts) in moe.plan.table.items()},
                plan_us={str(b): us for b, us in moe.plan.us.items()})


def moe_ref(moe, s):
    from ridge.kernels.moe_gemm import fused_moe_ref
    from ridge.kernels.moe_route import route_topk_ref
    w, e = route_topk_ref(s["logits"], moe.top_k, moe.renormalize)
    return fused_moe_ref(s["x"], moe.w13_weight, moe.w2_weight, w, e)


def e2e(a) -> dict:
    from ridge import LLM
    from ridge.bench.latency import run_latency

    t0 = time.perf_counter()
    llm = LLM(a.model, load_format="dummy", dtype="bfloat16", max_model_len=a.input_len + a.output_len + 8,
              max_num_seqs=max(a.batches), kv_cache_memory=int(a.kv_cache_memory), show_progress=False)
    out = dict(device=device_name(torch.device("cuda")), model=a.model, input_len=a.input_len, output_len=a.output_len,
               engine_build_s=time.perf_counter() - t0, ridge={}, hf={})
    print(f"  engine built in {out['engine_build_s']:.1f} s (dummy weights, MoE plans, CUDA graphs)", flush=True)
    for b in a.batches:
        r = run_latency(llm, b, a.input_len, a.output_len, a.iters, 1, progress=False)
        roof = r.get("roofline") or {}
        weights_mbu = roof["weight_bytes_per_step"] * roof["decode_steps"] / roof["decode_time_s"] / roof["bandwidth"]
        out["ridge"][b] = dict(decode_tokens_per_s=r["decode_tokens_per_s"], mbu=r["mbu"], weights_mbu=weights_mbu,
                               weight_bytes_per_step=roof["weight_bytes_per_step"], full=r)
        print(f"  ridge batch {b}: {r['decode_tokens_per_s']:.0f} tok/s, MBU {r['mbu']:.1%}, weights "
              f"{roof['weight_bytes_per_step'] / 1e9:.2f} GB/step at {weights_mbu:.1%}", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if a.hf:
        out["hf"] = hf_decode(a)
    return out


def hf_decode(a) -> dict:
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    res = {b: hf_batch(a, hf, cfg.vocab_size, b) for b in a.hf_batches}
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return res


def hf_batch(a, hf, vocab: int, b: int) -> dict:
    import transformers
    ids = torch.randint(3, vocab, (b, a.input_len), device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    with torch.inference_mode():
        gen(2)
        full, first = statistics.median(gen(a.hf_tokens) for _ in range(2)), statistics.median(gen(1) for _ in range(2))
    r = dict(decode_tokens_per_s=b * (a.hf_tokens - 1) / (full - first), new_tokens=a.hf_tokens,
             transformers=transformers.__version__)
    print(f"  hf batch {b}: {r['decode_tokens_per_s']:.1f} tok/s", flush=True)
    return r


def table(part: str, r: dict) -> str:
    if part == "kernels":
        rows = [[n, x["tokens"], x["path"], f"{x['ridge_us']:.1f}",
                 f"{x['reference_us'] / x['ridge_us']:.1f}x" if x["reference_us"] else "n/a",
                 f"{x['cublas_bmm_us'] / x['ridge_us']:.2f}x" if x["cublas_bmm_us"] else "n/a",
                 f"{x['mbu']:.1%}", f"{x['tflops']:.0f}", f"{x['mfu']:.1%}"]
                for n, s in r["shapes"].items() for x in s["rows"]]
        rows += [[n, g["tokens"], f"grouped ({g['pairs']} pairs)", f"{g['us']:.1f}", "", "", "", f"{g['tflops']:.0f}",
                  f"{g['fraction_of_roof']:.1%}"] for n, s in r["shapes"].items() for g in s["grouped"]]
        return format_table(["shape", "tokens", "path", "us", "vs ref", "vs bmm", "MBU", "TFLOP/s", "of roof"], rows,
                            title=f"MoE layer, bf16, {r['device']}")
    rows = [["ridge", b, f"{x['decode_tokens_per_s']:.0f}", f"{x['mbu']:.1%}", f"{x['weights_mbu']:.1%}"]
            for b, x in r["ridge"].items()]
    rows += [["hf", b, f"{x['decode_tokens_per_s']:.1f}", "", ""] for b, x in r["hf"].items()]
    return format_table(["engine", "batch", "decode tok/s", "MBU", "weights MBU"], rows, title=f"{r['model']}, {r['device']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    k.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    e = sub.add_parser("e2e")
    e.add_argument("--model", required=True, help="config-only checkpoint directory (dummy weights)")
    e.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    e.add_argument("--input-len", type=int, default=128)
    e.add_argument("--output-len", type=int, default=128)
    e.add_argument("--iters", type=int, default=3)
    e.add_argument("--kv-cache-memory", type=float, default=8e9)
    e.add_argument("--hf", action="store_true", help="also HF transformers on the same config, random weights")
    e.add_argument("--hf-batches", nargs="+", type=int, default=[1, 64])
    e.add_argument("--hf-tokens", type=int, default=16)
    for p in (k, e):
        p.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/moe.py needs a CUDA GPU (the kernels' CPU checks: tests/models/test_moe.py under TRITON_INTERPRET=1)")
    r = kernels(a) if a.part == "kernels" else e2e(a)
    if a.json:
        write_json(a.json, r)
    print(table(a.part, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
