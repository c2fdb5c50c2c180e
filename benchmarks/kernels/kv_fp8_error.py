"""Numerical error of attention over an FP8 KV cache, with and without the Hadamard rotation of q
and k (incoherent processing), on FlashAttention-3's synthetic inputs: q, k, v ~ N(0, 1) plus, in
0.1% of the entries, an outlier from N(0, 10^2). Errors are RMSE against float64 attention over
the unquantized values; the cache is ridge's format (ridge/kernels/kv_fp8.py: e4m3 rows with a
power-of-two scale per token and kv head) and the rotation its kernels' (q and k times H D / sqrt(d)).
FA3 reports 2.6x lower error with the rotation (its FP8 covers Q, K and V with per-tensor scales,
ridge's only the cache, per row). CPU or GPU, seconds.

    python benchmarks/kernels/kv_fp8_error.py [--json PATH] [--seqlen 1024] [--head-dim 128] [--heads 8] [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from ridge.kernels.kv_fp8 import dequantize_rows_ref, hadamard_signs, quantize_rows_ref  # noqa: E402


def with_outliers(shape, gen, rate=1e-3, scale=10.0):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.rand(shape, generator=gen, dtype=torch.float64) < rate
    return x + mask * torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def attention(q, k, v):
    """[H, L, d] each; causal softmax attention in float64."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def errors(seqlen: int, d: int, heads: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (with_outliers((heads, seqlen, d), gen) for _ in range(3))
    exact = attention(q, k, v)
    fp8 = lambda x: dequantize_rows_ref(*quantize_rows_ref(x.float()), torch.float64)  # noqa: E731
    plain = attention(q, fp8(k), fp8(v))
    m = hadamard_signs(d, seed).double() / d ** 0.5
    rotated = attention(q @ m, fp8(k @ m), fp8(v))
    rmse = lambda o: float((o - exact).pow(2).mean().sqrt())  # noqa: E731
    return {"seed": seed, "rmse_fp8": rmse(plain), "rmse_fp8_hadamard": rmse(rotated),
            "k_rmse_fp8": float((fp8(k) - k).pow(2).mean().sqrt()),
            "k_rmse_fp8_hadamard": float((fp8(k @ m) - k @ m).pow(2).mean().sqrt())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    rows = [errors(args.seqlen, args.head_dim, args.heads, s) for s in range(args.seeds)]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key != "seed"}
    result = {"args": vars(args), "rows": rows, "mean": mean,
              "error_ratio": mean["rmse_fp8"] / mean["rmse_fp8_hadamard"],
              "k_error_ratio": mean["k_rmse_fp8"] / mean["k_rmse_fp8_hadamard"]}
    print(f"attention RMSE vs float64: FP8 KV {mean['rmse_fp8']:.3e}, FP8 KV + Hadamard {mean['rmse_fp8_hadamard']:.3e}"
          f" -> {result['error_ratio']:.2f}x lower with the rotation (K alone: {result['k_error_ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
