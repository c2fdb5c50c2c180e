"""The expert kernels' inner loops as Hopper runs them, read without a GPU; JSON to --json, a table last.

Each kernel is compiled by Triton for sm_90a (a GPUTarget, no device needed) with the
specialization a launch at the DeepSeek-V2-Lite expert shape gets (pointers and 16-divisible
strides marked divisible by 16, the tiles as constexprs), assembled by the ptxas Triton's own
compiler picks for sm_90a (`-v`: registers a thread, spilled bytes), and disassembled by its
cuobjdump. Per kernel: the SASS instructions of one iteration of its K loop (the body of the backward branch that holds
the most instructions) by opcode, divided by the weights a thread handles in that iteration.
The question it answers is the one a bandwidth-bound decode kernel must pass: does each weight
cost few enough instructions for its bytes to arrive at HBM speed (the dense INT4 GEMV's
docstring: ~4 instructions a weight is the budget), and does the tile fit the register file
(a spill is a local-memory round trip in the loop).

    python benchmarks/kernels/kernel_sass.py --json kernel_sass.json
    python benchmarks/kernels/kernel_sass.py --kernels "small down" --formats int4 --int4-gemv   # + the dense INT4 GEMV
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from ridge.bench.common import format_table, write_json  # noqa: E402

V2_LITE = dict(E=64, top_k=6, H=2048, I=1408)


def tools() -> dict[str, str]:
    """The ptxas Triton itself runs for sm_90a (its NVIDIA backend's choice, TRITON_PTXAS_PATH or
    TRITON_PTXAS_BLACKWELL_PATH honoured): the PTX a Triton emits carries a version only the
    ptxas it ships can read (Triton 3.9 emits PTX 9.x and assembles Hopper with its
    `ptxas-blackwell`, a CUDA 13 ptxas; its CUDA 12.8 `ptxas` rejects that PTX). cuobjdump likewise."""
    import triton
    if triton.knobs.runtime.interpret:
        raise SystemExit("kernel_sass: TRITON_INTERPRET=1 makes the kernels interpreted functions, which do not "
                         "compile: run without it")
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        found = {"ptxas": get_ptxas(90).path, "cuobjdump": triton.knobs.nvidia.cuobjdump.path}
    except RuntimeError as e:            # a knob naming a missing tool
        raise SystemExit(f"kernel_sass: {e}")
    missing = [p for p in found.values() if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"kernel_sass: {', '.join(missing)} not found (Triton's NVIDIA backend ships them)")
    return found


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, divisible: set[str], num_warps: int = 4,
                 num_stages: int = 3) -> str:
    """PTX of fn for sm_90a; signature maps each argument to its Triton type ("*bf16", "i32",
    "constexpr"); the arguments named in divisible carry tt.divisibility 16, as a launch with
    16-aligned pointers and 16-divisible integers would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(signature)
    # a constexpr is no argument of the compiled function: an attribute on it would land on the
    # next real argument (Triton 3.9 sets attributes by position among the real ones)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in divisible and signature[n] != "constexpr"}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]


def assemble(ptx: str, bins: dict[str, str]) -> dict:
    """Registers, spilled bytes and the hottest loop's instruction mix of a PTX module (sm_90a)."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([bins["ptxas"], "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                              check=True).stderr
        sass = subprocess.run([bins["cuobjdump"], "-sass", cubin], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    return dict(registers=regs, spill_bytes=spill, loop=hottest_loop(sass))


def hottest_loop(sass: str) -> dict[str, int]:
    """Opcode counts of the largest body between a backward branch and its target."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] = []
    for i, (a, text) in enumerate(ins):
        targets = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < a and int(targets[-1], 16) in where:
            body = [t for _, t in ins[where[int(targets[-1], 16)]:i + 1]]
            best = body if len(body) > len(best) else best
    ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in best)
    return dict(ops.most_common())


def _int4_planes(sig: dict, consts: dict) -> None:
    """The small path's INT4 kernels (ridge/kernels/moe_int4.py) take ASM where the others take FMT."""
    del sig["FMT"], consts["FMT"]
    sig["ASM"], consts["ASM"] = "constexpr", True


def small_gate_up(fmt: int, s: dict, block_n=16, block_k=128, warps=4, stages=3):
    from ridge.kernels.moe_gemm import _small_gate_up_kernel
    from ridge.kernels.moe_int4 import _small_gate_up_int4_kernel, _small_gate_up_int4_mma_kernel
    sig = dict(X="*bf16", W="*i32" if fmt == 2 else "*bf16", WS="*bf16", WZ="*bf16", Experts="*i32", Out="*bf16",
               inter="i32", K="constexpr", TOP_K="constexpr", stride_xt="i32", stride_we="i32", stride_wn="i32",
               stride_se="i32", stride_sn="i32", stride_ot="i32", BLOCK_N="constexpr", BLOCK_K="constexpr",
               NUM_STAGES="constexpr", EMULATE_RNE="constexpr", PDL="constexpr", FMT="constexpr")
    consts = dict(K=s["H"], TOP_K=s["top_k"], BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, EMULATE_RNE=False,
                  PDL=True, FMT=fmt)
    weights = 2 * block_n * block_k // (32 * warps)          # gate and up, a thread's share of one K step
    if fmt == 2:
        _int4_planes(sig, consts)
        if block_k == 128:             # the tensor-core variant: no BLOCK_K argument
            del sig["BLOCK_K"], consts["BLOCK_K"]
            return _small_gate_up_int4_mma_kernel, sig, consts, warps, stages, weights
    return _small_gate_up_int4_kernel if fmt == 2 else _small_gate_up_kernel, sig, consts, warps, stages, weights


def small_down(fmt: int, s: dict, block_n=16, block_k=16, warps=4, stages=3):
    from ridge.kernels.moe_gemm import _small_down_kernel
    from ridge.kernels.moe_int4 import _small_down_int4_kernel
    sig = dict(Hid="*bf16", W="*i32" if fmt == 2 else "*bf16", WS="*bf16", WZ="*bf16", Experts="*i32", RouteW="*fp32",
               Out="*bf16", N="i32", K="constexpr", TOP_K="constexpr", stride_hp="i32", stride_we="i32",
               stride_wn="i32", stride_se="i32", stride_sn="i32", stride_ot="i32", BLOCK_TK="constexpr",
               BLOCK_N="constexpr", BLOCK_K="constexpr", NUM_STAGES="constexpr", EMULATE_RNE="constexpr",
               PDL="constexpr", FMT="constexpr")
    tk = 1 << (s["top_k"] - 1).bit_length()
    consts = dict(K=s["I"], TOP_K=s["top_k"], BLOCK_TK=tk, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                  EMULATE_RNE=False, PDL=True, FMT=fmt)
    if fmt == 2:
        _int4_planes(sig, consts)
    return (_small_down_int4_kernel if fmt == 2 else _small_down_kernel, sig, consts, warps, stages,
            tk * block_n * block_k // (32 * warps))


def grouped(fmt: int, s: dict, gated: bool, block_m=64, block_n=64, block_k=64, warps=4, stages=3):
    from ridge.kernels.moe_gemm import _grouped_kernel
    sig = dict(X="*bf16", W="*i32" if fmt == 2 else "*bf16", WS="*bf16", WZ="*bf16", Out="*bf16", PairOrder="*i32",
               BlockExpert="*i32", RouteW="*fp32", Scratch="*bf16", Arrived="*i32", num_pairs="i32", N="i32", K="i32",
               x_rows_per_pair="i32", num_blocks="i32", stride_xm="i32", stride_we="i32", stride_wn="i32",
               stride_se="i32", stride_sn="i32", stride_om="i32", BLOCK_M="constexpr", BLOCK_N="constexpr",
               BLOCK_K="constexpr", GROUP_M="constexpr", GATED="constexpr", TOP_K="constexpr", FUSE_SUM="constexpr",
               EMULATE_RNE="constexpr", PDL="constexpr", FMT="constexpr", PLANES="constexpr", ASM="constexpr")
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, GATED=gated,
                  TOP_K=0 if gated else s["top_k"], FUSE_SUM=not gated, EMULATE_RNE=False, PDL=True, FMT=fmt,
                  PLANES=fmt == 2 and block_k == 128, ASM=True)
    return _grouped_kernel, sig, consts, warps, stages, (2 if gated else 1) * block_n * block_k // (32 * warps)


KERNELS = {"small gate/up": lambda fmt, s: small_gate_up(fmt, s, **({} if fmt == 0 else dict(block_n=64, warps=2))),
           "small down": small_down,
           # INT4 grouped: the nibble planes, one 128-wide group a K step
           "grouped gate/up": lambda fmt, s: grouped(fmt, s, True, block_k=128 if fmt == 2 else 64),
           "grouped down": lambda fmt, s: grouped(fmt, s, False, block_k=128 if fmt == 2 else 64)}
FORMATS = {"bf16": 0, "int4": 2}


def dense_int4_gemv(N: int = 57344, K: int = 8192):
    """The dense INT4 GEMV (ridge/kernels/int4_gemv.py) at batch 1 with the config int4_matmul takes
    (default: the Llama-3-70B gate_up): kernel, signature, constexprs, warps, stages, weights a thread."""
    from ridge.kernels.int4_gemv import _int4_gemv_kernel, int4_gemv_config
    c = int4_gemv_config(1, N, K, 128)
    sig = dict(X="*bf16", QW="*i32", S="*bf16", Z="*bf16", Y="*bf16", P="*fp32", C="*i32", M="i32", N="i32",
               stride_xm="i32", stride_ym="i32")
    consts = dict(K=K, G=128, M_BLOCKS=1, BM=16, BN=c.block_n, BK=c.block_k, SPLIT_K=c.split_k,
                  TILES=K // c.block_k // c.split_k, EVEN_K=True, EVEN_N=N % c.block_n == 0, ROW_SCALES=False,
                  ASM=True, EMULATE_RNE=False, PDL=True, NUM_STAGES=c.num_stages)
    sig.update({k: "constexpr" for k in consts})
    return _int4_gemv_kernel, sig, consts, c.num_warps, c.num_stages, c.block_n * c.block_k // (32 * c.num_warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--int4-gemv", action="store_true",
                    help="also the dense INT4 GEMV at the 70B gate_up shape, batch 1 (int4_matmul's config)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bins = tools()
    rows = []
    jobs = [(name, fmt_name, lambda name=name, fmt_name=fmt_name: KERNELS[name](FORMATS[fmt_name], V2_LITE))
            for name in a.kernels for fmt_name in a.formats]
    if a.int4_gemv:
        jobs.append(("dense gemv 70B gate_up", "int4", dense_int4_gemv))
    for name, fmt_name, build in jobs:
        fn, sig, consts, warps, stages, weights = build()
        divisible = {n for n, t in sig.items() if t.startswith("*") or n in ("N", "K", "inter") or
                     n.startswith("stride")}
        r = assemble(compile_sm90(fn, sig, consts, divisible, warps, stages), bins)
        total = sum(r["loop"].values())
        rows.append(dict(kernel=name, format=fmt_name, consts={k: v for k, v in consts.items()}, num_warps=warps,
                         tile=" x ".join(str(consts[k]) for k in ("BLOCK_TK", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BM", "BN",
                                                                  "BK") if k in consts) + f", {warps} warps", **r,
                         loop_instructions=total, weights_per_thread=weights,
                         instructions_per_weight=total / weights))
        print(f"  {name} {fmt_name}: {r['registers']} registers, {r['spill_bytes']} B spilled, {total} "
              f"instructions a K step ({total / weights:.1f} a weight)", flush=True)
    if a.json:
        write_json(a.json, dict(target="sm_90a", shape=V2_LITE, rows=rows))
    print(format_table(["kernel", "format", "tile", "registers", "spilled B", "loop instr.", "instr./weight",
                        "top opcodes"],
                       [[r["kernel"], r["format"], r["tile"], r["registers"], r["spill_bytes"], r["loop_instructions"],
                         f"{r['instructions_per_weight']:.1f}", " ".join(f"{k}{v}" for k, v in list(r["loop"].items())[:5])]
                        for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
