"""The warp-specialized Gluon INT4 GEMV (ridge/kernels/int4_gemv_ws.py). Triton's interpreter does
not run Gluon, so on any machine the kernel is compiled for sm_90a (a TMA ring, warp-specialized
partitions, no spills, under whichever Triton runs the tests: CI runs this file under the newest and
under the GPU machines' 3.6); on the GPU it is checked against the fp64 reference of the same
dequantized weight at the 8B and 70B projection shapes, split and unsplit, bit-stable from call to
call with the split-K counters left zeroed."""
import re

import pytest
import torch
import triton

from ridge.kernels import int4_gemv as gv
from ridge.kernels import int4_gemv_ws as ws
from tests.kernels.test_int4_kernels import BF16, FP16, LLAMA8B, LLAMA70B, check, make, needs_gpu


def compile_for_hopper(cfg: ws.Int4GemvWsConfig, dtype: str = "bf16", tiles: int = 4):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    desc = f"tensordesc<i32[{cfg.block_k // 8}, {cfg.block_n}],{ws.weight_layout(cfg.block_n)!r}>"
    sig = {"X": f"*{dtype}", "qw_desc": desc, "S": f"*{dtype}", "Z": f"*{dtype}", "Y": f"*{dtype}", "P": "*fp32",
           "C": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    const = {"G": 128, "BM": 16, "BN": cfg.block_n, "BK": cfg.block_k, "TILES": tiles, "STAGES": cfg.stages,
             "SPLIT_K": cfg.split_k, "num_warps": cfg.num_warps}
    src = GluonASTSource(ws._int4_gemv_ws_kernel, signature={**sig, **{k: "constexpr" for k in const}},
                         constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64),
                          options={"num_warps": cfg.num_warps, "maxnreg": ws.MAX_REGISTERS})


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compiles_for_hopper_to_a_tma_ring_feeding_tensor_cores(dtype):
    cfg = ws.Int4GemvWsConfig(128, 128, 4, 8, 4)
    k = compile_for_hopper(cfg, dtype)
    ptx = k.asm["ptx"]
    # one [16, 128] int32 tile a stage: TMA boxes of 128 bytes (the swizzle's width), so 4 copies
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) % 4 == 0 and "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait" in ptx and "setmaxnreg" in ptx          # partitions with their own registers
    # each consumer warp: 128 / 4 = 32 columns = 4 MMA n-tiles, times eight nibble planes
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == 8 * 4
    assert "prmt.b32" in ptx and "lop3.b32" in ptx                     # the two-weights-a-sequence dequant
    assert k.metadata.shared >= cfg.stages * 16 * 128 * 4
    assert "cp.async.ca" not in ptx and "cp.async.cg" not in ptx     # no per-thread copies left


def test_scope_and_its_error():
    cfg = ws.Int4GemvWsConfig(128, 128, 4, 8, 2)
    assert ws.supported(1, 4096, 4096, 128, BF16, cfg) and ws.supported(16, 28672, 4096, 128, FP16, cfg)
    assert not ws.supported(17, 4096, 4096, 128, BF16, cfg)            # M > 16: the Triton kernels
    assert not ws.supported(1, 4000, 4096, 128, BF16, cfg)             # N not a multiple of BLOCK_N
    assert not ws.supported(1, 4096, 4096 + 128, 128, BF16, cfg)       # K not whole tiles per split
    assert not ws.supported(1, 4096, 4096, 64, BF16, cfg)              # a group smaller than a tile
    assert not ws.supported(1, 4096, 4096, 128, torch.float32, cfg)
    x, qw, s, z = make(1, 4000, 512, 128, BF16, 0)
    with pytest.raises(ValueError, match="outside the kernel's scope"):
        ws.int4_gemv_ws(x, qw, s, z, 128, torch.empty(1, 4000, dtype=BF16), cfg)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gpu_matches_the_reference_at_model_shapes(M, dtype):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA and warp specialization need Hopper")
    seed = int.from_bytes(__import__("os").urandom(4), "little")
    shapes = {**LLAMA8B, "70b-o": LLAMA70B["o"], "70b-down": LLAMA70B["down"]}
    for name, (N, K) in shapes.items():
        x, qw, s, z = make(M, N, K, 128, dtype, seed, device="cuda")
        for split in (1, 4):
            cfg = ws.Int4GemvWsConfig(128, 128, 4, 8, split)
            out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
            y = ws.int4_gemv_ws(x, qw, s, z, 128, out, cfg)
            check(y, x, qw, s, z, 128, weight_rounded=False, what=f"{name} M={M} split {split} {dtype} seed {seed}")
            assert torch.equal(y, ws.int4_gemv_ws(x, qw, s, z, 128, torch.empty_like(out), cfg)), seed
    torch.cuda.synchronize()
    assert not gv.ticket_counters(torch.device("cuda")).any()
