"""The W4A16 kernels (ridge/kernels/int4_gemv.py, int4_gemm.py, via int4_matmul) against the
dequantize-then-matmul reference, the dispatch, the PTX dequant's bit arithmetic, and the plan of
benchmarks/kernels/int4_gemm.py.

On CPU the kernels run under the Triton interpreter (chosen before triton is imported) at small
odd shapes: N not a multiple of the block, K over several groups and tiles, group_size = K, the
K tail, uneven split-K ranges, a group size that does not divide K (a short last group). With a GPU
the `gpu` tests run the Llama-3-8B shapes and DeepSeek-V2-Lite's short-group down projection.

Error contract, against the fp64 product of the same inputs and the same dequantized weight
W = (q - z) s: every path multiplies x by q - z exactly (16-bit values, products exact in fp32)
and sums in fp32 in its own order, then rounds once to x's dtype, so
  |y - ref| <= u_out |ref| + (K + 8) u32 (|x| @ |W|)            (u32 = 2^-24; u_out = 2^-8 bf16,
where the 8 covers the scale multiplications and the split-K partial sums. The paths that scale
each weight before the MMA (group_size < BLOCK_K, and the M > 32 GEMM) round (q - z) s once to
x's dtype: one more u_w (|x| @ |W|) term (u_w = 2^-8 bf16, 2^-11 fp16). Checked with a factor-2
margin; int4_matmul_ref (fp32) is compared through the same bound.
"""
import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

from ridge.kernels import int4_gemv as gv  # noqa: E402
from ridge.kernels.int4_gemm import gemm_split_k  # noqa: E402
from ridge.kernels.int4_matmul import dequantize_int4, int4_matmul, int4_matmul_ref, pack_int4  # noqa: E402
from tests.tests_support import load_benchmark  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
U = {BF16: 2.0**-8, FP16: 2.0**-11}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU-tensor kernel tests run under TRITON_INTERPRET=1")


def make(M, N, K, G, dtype, seed, device="cpu"):
    """Random x and INT4 tables (never zeros): q uniform in [0, 15], integer zeros in [0, 16]
    (16: GPTQ's v1 zero point + 1), positive scales ~ 1 / sqrt(K)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g, device=device)
    scales = ((torch.rand(-(-K // G), N, generator=g, device=device) + 0.5) * 0.3 / K**0.5).to(dtype)
    zeros = torch.randint(0, 17, (-(-K // G), N), generator=g, device=device).to(dtype)
    x = (2 * torch.randn(M, K, generator=g, device=device)).to(dtype)
    return x, pack_int4(q), scales, zeros


def check(y, x, qw, s, z, G, weight_rounded, what=""):
    assert y.dtype == x.dtype and not torch.isnan(y).any(), f"{what}: NaN (an unwritten output)"
    w = dequantize_int4(qw, s, z, G).double()
    ref = x.double() @ w
    mag = x.double().abs() @ w.abs()
    u = U[x.dtype]
    bound = u * ref.abs() + ((x.shape[1] + 8) * 2.0**-24 + (u if weight_rounded else 0)) * mag
    err = (y.double() - ref).abs()
    assert (err <= 2 * bound + 1e-30).all(), f"{what}: worst excess {(err / (2 * bound + 1e-30)).max():.2f}x"


def run_kernel(x, qw, s, z, G, config=None):
    out = torch.full((x.shape[0], qw.shape[1]), float("nan"), dtype=x.dtype, device=x.device)   # poisoned
    if config is None:
        return int4_matmul(x, qw, s, z, G, out=out)
    return gv.int4_gemv(x, qw, s, z, G, out, config)


# ------------------------------------------------------------------------------- CPU interpreter
@interpreted
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 33])
def test_skinny_kernel_matches_reference(M, dtype, split):
    """N = 72 (2.25 blocks of 32), K = 384 (6 tiles of 64; split 4 leaves uneven ranges, one of them
    empty), each M with another group size: 32 and 64 scale per word row, 128 and K per tile."""
    G = {1: 128, 3: 32, 16: 384, 17: 64, 33: 128}[M]
    N, K = 72, 384
    x, qw, s, z = make(M, N, K, G, dtype, seed=10 * M + split)
    y = run_kernel(x, qw, s, z, G, gv.Int4GemvConfig(32, 64, 1, 1, split))
    check(y, x, qw, s, z, G, weight_rounded=G < 64, what=f"M={M} G={G} {dtype} split={split}")
    check(int4_matmul_ref(x, qw, s, z, G), x, qw, s, z, G, False, "reference")


@interpreted
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,G", [(33, 32), (80, 256)])
def test_gemm_kernel_matches_reference(M, G, dtype):
    """M > 32 takes the GEMM (interpreter tile 32 x 32 x 64, split-K 2 at K = 256)."""
    x, qw, s, z = make(M, 40, 256, G, dtype, seed=M)
    check(run_kernel(x, qw, s, z, G), x, qw, s, z, G, weight_rounded=True, what=f"gemm M={M} G={G} {dtype}")


@interpreted
def test_gemm_with_a_given_tile():
    """int4_gemm with a fixed tile (the benchmark's sweep) instead of the autotuner's: 32 x 16 x 32
    tiles over M = 50, N = 40, K = 256 at G = 64 (per-tile scales, split-K 2)."""
    from ridge.kernels.int4_gemm import Int4GemmConfig, int4_gemm
    x, qw, s, z = make(50, 40, 256, 64, BF16, seed=7)
    out = torch.full((50, 40), float("nan"), dtype=BF16)
    check(int4_gemm(x, qw, s, z, 64, out, Int4GemmConfig(32, 16, 32, 1, 1)), x, qw, s, z, 64, True, "given tile")


@interpreted
def test_group_size_k_with_a_k_tail_and_leading_dims():
    """One group per column, K = 200 (not a multiple of the 64-wide tile); x [2, 3, K] -> [2, 3, N]."""
    x, qw, s, z = make(6, 24, 200, 200, BF16, seed=3)
    y = int4_matmul(x.view(2, 3, 200), qw, s, z, 200)
    assert y.shape == (2, 3, 24)
    check(y.reshape(6, 24), x, qw, s, z, 200, False, "G=K")
    x, qw, s, z = make(70, 24, 200, 200, FP16, seed=4)
    check(run_kernel(x, qw, s, z, 200), x, qw, s, z, 200, True, "gemm G=K")


@interpreted
@pytest.mark.parametrize("M,K,G,split", [(1, 320, 128, 1), (3, 320, 128, 2), (2, 200, 32, 1), (40, 320, 128, 0),
                                         (40, 200, 32, 0)])
def test_short_last_group(M, K, G, split):
    """G not dividing K (DeepSeek-V2-Lite's down projection: K = 10944 = 85.5 x 128): the tables have
    ceil(K / G) rows and the kernels give the unpadded product. K = 320 (an odd multiple of the 64-wide
    interpreter tile: whole tiles, the last group half a group; split 2 leaves a masked empty tile),
    K = 200 (the last tile 8 wide, per-word-row scales at G = 32). split 0: int4_matmul's choice (the
    GEMM at M = 40). The weights past K are never read: padding the same tables with garbage rows
    (and x with zeros) gives the same output."""
    x, qw, s, z = make(M, 24, K, G, BF16, seed=K + M)
    assert s.shape == (-(-K // G), 24)
    y = run_kernel(x, qw, s, z, G, gv.Int4GemvConfig(16, 64, 1, 1, split) if split else None)
    check(y, x, qw, s, z, G, weight_rounded=G < 64 or M > gv.GEMV_MAX_M, what=f"M={M} K={K} G={G} split={split}")
    kp = -(-K // G) * G                            # the padded product: x zero past K, any weights there
    qp = torch.cat([qw, torch.full((kp // 8 - K // 8, 24), -1, dtype=torch.int32)])
    xp = torch.nn.functional.pad(x, (0, kp - K))
    check(y, xp, qp, s, z, G, weight_rounded=G < 64 or M > gv.GEMV_MAX_M, what="against the padded product")
    with pytest.raises(ValueError, match=rf"scales must be \[{-(-K // G)}, 24\]"):
        int4_matmul(x, qw, s[:-1], z, G)             # a table with K // G rows: the short group missing


@interpreted
def test_split_k_is_deterministic_and_leaves_its_counters_zeroed():
    x, qw, s, z = make(5, 40, 512, 128, BF16, seed=5)
    cfg = gv.Int4GemvConfig(32, 64, 1, 1, 3)         # two N tiles, the second 8 wide
    a = run_kernel(x, qw, s, z, 128, cfg)
    b = run_kernel(x, qw, s, z, 128, cfg)
    assert torch.equal(a, b)
    assert not gv.ticket_counters(x.device).any()
    # the split order is fixed: the same sums as the unsplit kernel up to fp32 reassociation
    check(a, x, qw, s, z, 128, False, "split 3")


def test_cpu_without_interpreter_and_fp32_use_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # triton.knobs.runtime.interpret reads it per call
    x, qw, s, z = make(3, 16, 64, 32, BF16, seed=6)
    assert torch.equal(int4_matmul(x, qw, s, z, 32), int4_matmul_ref(x, qw, s, z, 32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x32, s32, z32 = x.float(), s.float(), z.float()
    assert torch.equal(int4_matmul(x32, qw, s32, z32, 32), int4_matmul_ref(x32, qw, s32, z32, 32))
    assert int4_matmul(x[:0], qw, s, z, 32).shape == (0, 16)


def test_bad_arguments_are_named():
    x, qw, s, z = make(2, 16, 64, 32, BF16, seed=7)
    with pytest.raises(ValueError, match="int32"):
        int4_matmul(x, qw.float(), s, z, 32)
    with pytest.raises(ValueError, match="K = 56"):
        int4_matmul(x[:, :56], qw, s, z, 32)
    with pytest.raises(ValueError, match="group_size 24"):
        int4_matmul(x, qw, s, z, 24)
    with pytest.raises(ValueError, match="group_size 48"):
        int4_matmul(torch.randn(2, 96).to(BF16), pack_int4(torch.zeros(96, 16, dtype=torch.int64)),
                    s[:1].expand(2, 16), z[:1].expand(2, 16), 48)
    with pytest.raises(ValueError, match="scales"):
        int4_matmul(x, qw, s.float(), z, 32)
    with pytest.raises(ValueError, match="zeros"):
        int4_matmul(x, qw, s, z[:1], 32)
    with pytest.raises(ValueError, match="out"):
        int4_matmul(x, qw, s, z, 32, out=torch.empty(2, 15, dtype=BF16))


# ---------------------------------------------------------------- the GPU dequant, modelled in Python
def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _run_asm(asm, a, b):
    """Execute the plane's PTX (prmt, shr.u32, lop3 with LUT 0xEA = (x & y) | z) on two words."""
    sel = int(re.search(r"prmt\.b32 t, \$1, \$2, (0x[0-9a-f]+);", asm).group(1), 16)
    t = _prmt(a, b, sel)
    shift = re.search(r"shr\.u32 t, t, (\d+);", asm)
    t = t >> int(shift.group(1)) if shift else t
    mask, magic, lut = (int(v, 16) for v in re.search(r"lop3\.b32 \$0, t, (\w+), (\w+), (\w+);", asm).groups())
    assert lut == 0xEA
    return (t & mask) | magic


@pytest.mark.parametrize("dt,magic", [("bf16", 128.0), ("fp16", 1024.0)])
def test_ptx_plane_dequant_gives_magic_plus_nibble_for_both_words(dt, magic):
    """The kernel's PTX, executed on random words: the low 16 bits are nibble j of the first word
    as the 16-bit float MAGIC + q, the high 16 bits the same for the second word."""
    g = torch.Generator().manual_seed(8)
    words = torch.randint(0, 2**32, (64, 2), generator=g, dtype=torch.int64).tolist()
    to_float = {"bf16": lambda h: torch.tensor([h << 16], dtype=torch.int32).view(torch.float32).item(),
                "fp16": lambda h: torch.tensor([h], dtype=torch.int16 if h < 2**15 else torch.int32)
                .to(torch.int16).view(torch.float16).item()}[dt]
    for j, asm in enumerate(gv.PLANE_ASM[dt]):
        for a, b in words:
            r = _run_asm(asm, a, b)
            assert to_float(r & 0xFFFF) == magic + ((a >> (4 * j)) & 0xF), (dt, j, hex(a))
            assert to_float(r >> 16) == magic + ((b >> (4 * j)) & 0xF), (dt, j, hex(b))


# ------------------------------------------------------------------------------- heuristics
LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LLAMA70B = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672),
            "kv": (1024, 8192)}


def test_skinny_configs_fill_the_sms_within_the_partial_budget():
    for N, K in [*LLAMA8B.values(), *LLAMA70B.values()]:
        for M in (1, 2, 4, 8, 16, 32, 64):
            c = gv.int4_gemv_config(M, N, K, 128, 132)
            bm = gv.block_m_for(M)
            tiles = -(-K // c.block_k)
            blocks = -(-N // c.block_n) * -(-M // bm)
            cap = min(32, tiles // 2, K // (32 * M))
            assert c.block_k == 128 and tiles % c.split_k == 0 and tiles // c.split_k >= 2
            assert c.split_k * M * N * 4 <= N * K / 2 / 4 or c.split_k == 1     # partials <= 1/4
            # about TILES_PER_PROGRAM tiles a program (within a factor of 2), or more splits to give
            # every SM a program, or the cap
            per = tiles / c.split_k
            assert (gv.TILES_PER_PROGRAM / 2 <= per <= 2 * gv.TILES_PER_PROGRAM or per >= 4 and blocks * c.split_k
                    <= 8 * 132 or 2 * c.split_k > cap or tiles % (2 * c.split_k))
            assert c.num_warps == (2 if bm == 16 else 4) and c.block_n == 128
            assert c.num_stages == (3 if bm == 16 else 4)
    # the 70B projections at batch 1, the splits an H200 sweep found fastest or near it (BENCHMARKS.md)
    assert [gv.int4_gemv_config(1, *LLAMA70B[p], 128).split_k for p in ("qkv", "gate_up", "down")] == [8, 4, 16]
    assert [gv.int4_gemv_config(1, *LLAMA8B[p], 128).split_k for p in ("qkv", "o", "gate_up")] == [8, 8, 4]
    assert gv.int4_gemv_config(1, 1024, 8192, 128).split_k == 16          # 70B k/v: 8 blocks, 4 tiles a program
    assert gv.int4_gemv_config(16, 4096, 4096, 128).split_k == 8          # partial cap K / 32M = 8
    assert gv.int4_gemv_config(1, 4096, 14336, 128).split_k == 16         # 112 tiles: the splits dividing it
    assert gemm_split_k(128, 4096, 4096, 132) == 4 and gemm_split_k(512, 28672, 4096, 132) == 1


# ------------------------------------------------------------------------------ the benchmark
def test_benchmark_plan_and_dry_run(capsys, monkeypatch):
    b = load_benchmark("int4_gemm")
    monkeypatch.delenv("OUT", raising=False)
    cases = b.cases(b.parse_args([]))
    assert len(cases) == (5 + 5) * 9 and {c["M"] for c in cases} == {1, 2, 4, 8, 16, 32, 64, 128, 512}
    assert {(c["proj"], c["N"], c["K"]) for c in cases if c["model"] == "llama3-8b"} == {
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
        ("lm_head", 128256, 4096)}
    assert b.int4_bytes(dict(M=1, N=4096, K=4096), 128) == 4096 * 4096 // 2 + 2 * 2 * 32 * 4096 + 2 * (4096 + 4096)
    l2 = 50 << 20
    for N, K in LLAMA8B.values():
        sets = b.sets_for(N, K, 1, l2)
        assert sets * b.int4_bytes(dict(M=1, N=N, K=K), 128) > 2 * l2
    b.main(["--dry-run", "--models", "llama3-8b", "--rows", "1", "16", "--only", "o"])
    assert "2 cases" in capsys.readouterr().out
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    assert b.parse_args([]).json == "/tmp/somewhere/int4_gemm.json"
    for bad in (["--rows", "0"], ["--only", "nope"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


# ------------------------------------------------------------------------------- GPU, real shapes
def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")   # new inputs every run; printed on failure


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 4, 16, 32, 33, 64, 128, 300])
def test_gpu_llama8b_shapes(M, dtype):
    seed = fresh_seed()
    for name, (N, K) in LLAMA8B.items():
        for G in (128, 32) if name == "o" else (128,):
            x, qw, s, z = make(M, N, K, G, dtype, seed, device="cuda")
            y = run_kernel(x, qw, s, z, G)
            check(y, x, qw, s, z, G, weight_rounded=G < 128 or M > gv.GEMV_MAX_M,
                  what=f"{name} M={M} G={G} {dtype} seed {seed}")
            if M <= gv.GEMV_MAX_M:   # split-K: the same bits on every call, counters left zeroed
                assert torch.equal(y, run_kernel(x, qw, s, z, G)), seed
    torch.cuda.synchronize()
    assert not gv.ticket_counters(torch.device("cuda")).any()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 8, 32, 64, 300])
def test_gpu_short_last_group_v2_lite_down(M):
    """DeepSeek-V2-Lite's dense down projection, N = 2048, K = 10944 = 85.5 groups of 128: the K-tail
    tile half full and the tables' last row a half group, on the compiled kernels (PTX dequant)."""
    seed = fresh_seed()
    for dtype in (BF16, FP16):
        x, qw, s, z = make(M, 2048, 10944, 128, dtype, seed, device="cuda")
        y = run_kernel(x, qw, s, z, 128)
        check(y, x, qw, s, z, 128, weight_rounded=M > gv.GEMV_MAX_M, what=f"M={M} {dtype} seed {seed}")
    torch.cuda.synchronize()
    assert not gv.ticket_counters(torch.device("cuda")).any()


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replays_on_new_inputs():
    from tests.tests_support import capture_cuda_graph
    seed = fresh_seed()
    for M in (1, 16, 128):
        x, qw, s, z = make(M, 4096, 14336, 128, BF16, seed, device="cuda")
        int4_matmul(x, qw, s, z, 128)                        # first call outside capture
        graph, y = capture_cuda_graph(lambda: int4_matmul(x, qw, s, z, 128))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check(y, x, qw, s, z, 128, M > gv.GEMV_MAX_M, f"graph M={M} seed {seed}")
