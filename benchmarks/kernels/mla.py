"""Multi-head Latent Attention decode (issue 19): ridge's absorbed Triton kernel over a paged
latent cache at the DeepSeek-V2-Lite (16 heads) and V3 (128 heads) shapes (kv_lora_rank 512,
rope 64), batch 1..128 x context 4k..32k; JSON to --json, a table last.

Per case: the kernel alone as the engine runs it (its tiles and split count; split-KV + merge,
CUDA-graph replay), each tile set of TILES beside it (the fastest reported; --sweep-splits adds the
fastest's time at 1..64 splits), and the whole absorbed attention (q absorption and output up-projection by
batched GEMMs around it); achieved bandwidth of the latent bytes read ((r + rope) x 2 bytes a
cached token, once for all heads) over the measured copy bandwidth; TFLOP/s (2 (r + rope) + 2 r
a head a key) over the measured bf16 matrix roof. Peer, same run: PyTorch SDPA over the same
latents laid out contiguously (no pages; q [B, H, 1, r + rope], K [B, 1, L, r + rope] and V
[B, 1, L, r] with enable_gqa) - what a user gets from torch for the absorbed form.

Prefill (--prefill-lens): one prompt in the expanded form, ridge's whole path (gather, expansion
GEMM, Triton kernel) against the same expansion followed by causal SDPA.

    python benchmarks/kernels/mla.py --json mla_decode.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.timing import time_calls, try_time  # noqa: E402

from ridge.bench.common import device_name, format_table, write_json  # noqa: E402

SHAPES = {"deepseek-v2-lite": dict(H=16, nope=128, v=128), "deepseek-v3": dict(H=128, nope=128, v=128)}
R, ROPE, PAGE = 512, 64, 16
# (heads a program, keys a tile, warps, stages[, keys as the dots' M side])
TILES = {"deepseek-v2-lite": [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (16, 64, 8, 3),
                              (16, 64, 4, 2, True), (16, 64, 4, 3, True), (16, 64, 8, 2, True)],
         "deepseek-v3": [(16, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 3),
                         (16, 64, 4, 3, True), (32, 64, 4, 2, True), (64, 64, 8, 2, True)]}
SPLITS = [1, 2, 4, 8, 16, 32, 64]


def case(name: str, s: dict, B: int, L: int, gen, bw: float, roof: float, sweep_splits: bool) -> dict:
    from ridge.kernels.attention_meta import AttentionMetadata
    from ridge.kernels.mla_attention import (MLADecodeTiles, absorb_query, mla_decode_attention, mla_decode_tiles,
                                             mla_num_splits, unabsorb_output)

    H, pages_each = s["H"], -(-L // PAGE)
    cache = torch.randn(B * pages_each, PAGE, 1, R + ROPE, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(B * pages_each, device="cuda", generator=gen).view(B, pages_each).int()
    starts = list(range(B + 1))
    meta = AttentionMetadata(torch.zeros(B, dtype=torch.int64, device="cuda"),
                             torch.tensor(starts, dtype=torch.int32, device="cuda"),
                             torch.full((B,), L, dtype=torch.int32, device="cuda"), tables, starts, [L] * B, 1, L)
    q_nope = torch.randn(B, H, s["nope"], device="cuda", generator=gen).bfloat16()
    q_pe = torch.randn(B, H, ROPE, device="cuda", generator=gen).bfloat16()
    kv_b = (torch.randn(H * (s["nope"] + s["v"]), R, device="cuda", generator=gen) * R ** -0.5).bfloat16()
    q_lat = absorb_query(q_nope, kv_b).contiguous()
    scale = (s["nope"] + ROPE) ** -0.5
    latent_bytes = B * L * (R + ROPE) * 2
    flops = B * H * L * (2 * (R + ROPE) + 2 * R)
    tiles = {}
    for t in TILES[name]:
        tm = try_time(f"tiles {t}", lambda t=t: time_calls([lambda: mla_decode_attention(
            q_lat, q_pe, cache, meta, scale, tiles=MLADecodeTiles(*t))] * 5, reps=15))
        if tm is not None:
            tiles[t] = tm.median_us
    best = min(tiles, key=tiles.get)
    engine = time_calls([lambda: mla_decode_attention(q_lat, q_pe, cache, meta, scale)] * 5, reps=15).median_us
    auto = mla_num_splits(B, -(-H // best[0]), L, MLADecodeTiles(*best).num_warps, cache.device)
    splits = {}
    for n in SPLITS if sweep_splits else []:
        if n == 1 or L // n >= 128:
            tm = try_time(f"splits {n}", lambda n=n: time_calls([lambda: mla_decode_attention(
                q_lat, q_pe, cache, meta, scale, num_splits=n, tiles=MLADecodeTiles(*best))] * 5, reps=15))
            if tm is not None:
                splits[n] = tm.median_us
    whole = time_calls([lambda: unabsorb_output(mla_decode_attention(absorb_query(q_nope, kv_b), q_pe, cache,
                                                                     meta, scale), kv_b, s["nope"])] * 5,
                       reps=15).median_us
    # the peer: SDPA over the same latents, contiguous
    lat = cache[tables.long()].view(B, 1, pages_each * PAGE, R + ROPE)[:, :, :L]
    q_full = torch.cat((q_lat, q_pe), dim=-1)[:, :, None]
    sdpa = try_time("sdpa", lambda: time_calls([lambda: F.scaled_dot_product_attention(
        q_full, lat, lat[..., :R], scale=scale, enable_gqa=True)] * 5, reps=15))
    us = engine
    row = dict(shape=name, batch=B, context=L, heads=H, kernel_us=us, engine_tiles=list(mla_decode_tiles(H, B)),
               best_tiles=list(best), best_tiles_us=tiles[best], tiles_us={str(k): v for k, v in tiles.items()},
               attention_us=whole, auto_splits=auto,
               splits_us=splits, best_splits=min(splits, key=splits.get) if splits else None,
               latent_gb_per_s=latent_bytes / us / 1e3, fraction_of_copy=latent_bytes / us / 1e-6 / bw,
               tflops=flops / us / 1e6, fraction_of_roof=flops / us / 1e-6 / roof,
               sdpa_us=sdpa.median_us if sdpa else None, vs_sdpa=sdpa.median_us / us if sdpa else None)
    print(f"  {name} B={B} L={L}: {us:.1f} us (best tiles {tuple(best)} {tiles[best]:.1f} us), "
          f"{row['latent_gb_per_s']:.0f} GB/s = "
          f"{row['fraction_of_copy']:.1%} of copy, {row['tflops']:.0f} TFLOP/s; whole {whole:.1f} us; "
          f"sdpa {row['sdpa_us'] or float('nan'):.1f} us", flush=True)
    if splits:
        print(f"    splits (auto {auto}): " + ", ".join(f"{k} {v:.1f}" for k, v in splits.items()), flush=True)
    return row


def prefill_case(name: str, s: dict, L: int, gen, roof: float) -> dict:
    """One L-token prompt (batch 1, no cached prefix): ridge's expanded prefill (gather, expansion
    GEMM and the Triton kernel) against the same expansion + SDPA (causal, 192-wide q/k, 128-wide v)."""
    from ridge.kernels.attention_meta import AttentionMetadata
    from ridge.kernels.mla_prefill import mla_prefill_attention

    H, nope, v, pages = s["H"], s["nope"], s["v"], -(-L // PAGE)
    cache = torch.randn(pages, PAGE, 1, R + ROPE, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=gen).view(1, pages).int()
    meta = AttentionMetadata(torch.zeros(L, dtype=torch.int64, device="cuda"),
                             torch.tensor([0, L], dtype=torch.int32, device="cuda"),
                             torch.tensor([L], dtype=torch.int32, device="cuda"), table, [0, L], [L], L, L)
    q = torch.randn(L, H, nope + ROPE, device="cuda", generator=gen).bfloat16()
    kv_b = (torch.randn(H * (nope + v), R, device="cuda", generator=gen) * R ** -0.5).bfloat16()
    scale = (nope + ROPE) ** -0.5
    # eager: the expansion reads host-side lengths (prefill steps are not graphed)
    ours = time_calls([lambda: mla_prefill_attention(q, cache, kv_b, meta, scale, nope, v)], reps=10,
                      graph=False).median_us

    def peer():
        rows = cache[table.long()].view(-1, R + ROPE)[:L]
        kv = F.linear(rows[:, :R], kv_b).view(L, H, nope + v)
        k = torch.cat((kv[..., :nope], rows[:, None, R:].expand(-1, H, -1)), dim=-1)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                              is_causal=True, scale=scale)
    sdpa = try_time("sdpa prefill", lambda: time_calls([peer], reps=10, graph=False))
    flops = H * L * (L + 1) // 2 * (2 * (nope + ROPE) + 2 * v) + 2 * L * R * H * (nope + v)
    row = dict(shape=name, prefill=L, heads=H, ridge_us=ours, tflops=flops / ours / 1e6,
               fraction_of_roof=flops / ours / 1e-6 / roof, sdpa_us=sdpa.median_us if sdpa else None,
               vs_sdpa=sdpa.median_us / ours if sdpa else None)
    print(f"  prefill {name} L={L}: {ours:.0f} us, {row['tflops']:.0f} TFLOP/s; expansion + sdpa "
          f"{row['sdpa_us'] or float('nan'):.0f} us", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--prefill-lens", nargs="*", type=int, default=[1024, 4096, 16384],
                    help="prompt lengths of the expanded prefill's timing (none: skip it)")
    ap.add_argument("--sweep-splits", action="store_true",
                    help="also time the best tiles at 1..64 splits (auto_splits: mla_num_splits' count for them)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/mla.py needs a CUDA GPU (the kernel's CPU check: tests/models/test_mla.py, TRITON_INTERPRET=1)")
    from ridge.utils.ceilings import load_ceilings
    ceil = load_ceilings("cuda")
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = []
    for n in a.shapes:
        for B in a.batches:
            for L in a.contexts:
                rows.append(case(n, SHAPES[n], B, L, gen, ceil.bandwidth, ceil.peak("bf16"), a.sweep_splits))
                torch.cuda.empty_cache()
    prefill = [prefill_case(n, SHAPES[n], L, gen, ceil.peak("bf16")) for n in a.shapes for L in a.prefill_lens]
    r = dict(device=device_name(torch.device("cuda")), bandwidth=ceil.bandwidth, bf16_roof=ceil.peak("bf16"), rows=rows,
             prefill=prefill)
    if a.json:
        write_json(a.json, r)
    print(format_table(["shape", "B", "L", "us", "best tiles: us", "splits auto/best", "GB/s", "of copy", "TFLOP/s",
                        "of roof", "whole us", "vs SDPA"],
                       [[x["shape"], x["batch"], x["context"], f"{x['kernel_us']:.1f}",
                         ",".join(map(str, x["best_tiles"])) + f": {x['best_tiles_us']:.1f}",
                         f"{x['auto_splits']}/{x['best_splits'] or '-'}", f"{x['latent_gb_per_s']:.0f}",
                         f"{x['fraction_of_copy']:.1%}", f"{x['tflops']:.0f}", f"{x['fraction_of_roof']:.1%}",
                         f"{x['attention_us']:.1f}", f"{x['vs_sdpa']:.2f}x" if x["vs_sdpa"] else "n/a"] for x in rows],
                       title=f"MLA decode attention, bf16, {r['device']}"))
    if prefill:
        print(format_table(["shape", "L", "ridge us", "TFLOP/s", "of roof", "vs expansion + SDPA"],
                           [[x["shape"], x["prefill"], f"{x['ridge_us']:.0f}", f"{x['tflops']:.0f}",
                             f"{x['fraction_of_roof']:.1%}", f"{x['vs_sdpa']:.2f}x" if x["vs_sdpa"] else "n/a"]
                            for x in prefill], title="MLA prefill (expanded form), batch 1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
