"""Small-batch GEMV (ridge/kernels/gemv.py) vs its torch reference, the Linear dispatch, and the
plan of benchmarks/kernels/gemv.py.

On CPU the kernel runs under the Triton interpreter (chosen before triton is imported) at small
shapes whose N and K are not multiples of the tiles; with a GPU the `gpu` tests run it at the
Llama-3-8B shapes against an fp64 reference on fresh random inputs.

Error contract: both paths sum in fp32 and round once to the output dtype, so against the exact
(fp64) product of the same inputs |y - ref| <= u_out |ref| + K u32 (|x| @ |W|^T) (u32 = 2^-24,
u_out = 2^-8 for bf16), checked with a factor-2 margin. With act="silu_mul" the fused
activation rounds where silu_and_mul rounds, so it is checked against the product of the
reference's bf16 activation, with one more u_out |h| |W| term for the rare element where an
fp32-ulp difference in exp flips a rounding. In the interpreter the fused kernel equals
gemv(silu_and_mul(x)) bit for bit (same arithmetic, same tiles).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ridge.kernels.gemv import GEMV_MAX_ROWS, GemvConfig, gemv, gemv_config, gemv_ref  # noqa: E402
from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402
from ridge.layers import linear  # noqa: E402
from ridge.layers.activation import SiluAndMul  # noqa: E402
from ridge.layers.linear import Linear  # noqa: E402
from tests.tests_support import capture_cuda_graph, load_benchmark  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
U_OUT = {BF16: 2.0**-8, FP16: 2.0**-11, FP32: 2.0**-24}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU-tensor kernel tests run under TRITON_INTERPRET=1")
# the interpreter's tiles (gemv_config under TRITON_INTERPRET): BLOCK_N 16, BLOCK_K 32, on each path
FMA, DOT = GemvConfig(16, 32, 1, 1, False), GemvConfig(16, 32, 1, 1, True)


def gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def check(y, x, w, bias=None, act=None, what=""):
    """y against the fp64 product of the (rounded) inputs, within the contract's bound."""
    assert y.dtype == x.dtype and not torch.isnan(y).any(), what
    h = silu_and_mul_ref(x) if act == "silu_mul" else x    # the reference's own rounded activation
    ref = h.double() @ w.double().T + (bias.double() if bias is not None else 0)
    mag = h.double().abs() @ w.double().abs().T
    u = U_OUT[x.dtype]
    bound = u * ref.abs() + (h.shape[1] * 2.0**-24 + (u if act == "silu_mul" else 0)) * mag
    err = (y.double() - ref).abs()
    assert (err <= 2 * bound + 1e-30).all(), f"{what}: worst excess {(err / (2 * bound + 1e-30)).max():.2f}x"


# ------------------------------------------------------------------------------- CPU interpreter
@interpreted
@pytest.mark.parametrize("path", ["fma", "dot"])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_matches_reference(M, dtype, act, path):
    N, K = 72, 200                     # 4.5 row blocks, 6.25 K tiles: a partial block and a K tail
    g = gen(100 * M + (act is None))
    x = (2 * torch.randn(M, 2 * K if act else K, generator=g)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if M == 3 else None
    cfg = FMA if path == "fma" else DOT
    y = gemv(x, w, bias, act=act, config=cfg)
    check(y, x, w, bias, act, f"M={M} {dtype} {act} {path}")
    tol = 2.0**-6 if dtype == BF16 else 1e-5                # vs F.linear: its own fp32 summation order
    torch.testing.assert_close(y, gemv_ref(x, w, bias, act), rtol=tol, atol=tol)


@interpreted
def test_gemv_default_config_strided_inputs_out_and_fp16():
    """The heuristic config (dot at M > 1), x a strided view, a preallocated out, fp16."""
    g = gen(7)
    N, K = 40, 72
    buf = torch.randn(4, 3 * K, generator=g).to(FP16)
    x = buf[:, 1:1 + 2 * K:2]                        # row stride 3K, column stride 2
    w = (torch.randn(N, K, generator=g) / K**0.5).to(FP16)
    out = torch.full((4, N), float("nan"), dtype=FP16)
    assert gemv(x, w, out=out) is out
    check(out, x, w, what="strided fp16")
    gu = torch.randn(2, 2 * K, generator=g).to(BF16)
    wb = w.to(BF16)
    check(gemv(gu, wb, act="silu_mul"), gu, wb, act="silu_mul", what="default config, silu")
    assert gemv(x[:0], w).shape == (0, N)


@interpreted
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # exp(100) = inf: intended
@pytest.mark.parametrize("path", ["fma", "dot"])
def test_fused_silu_equals_the_unfused_kernels(path):
    """Same tiles, same arithmetic: the fused activation is silu_and_mul's, bit for bit."""
    g = gen(11)
    x = (3 * torch.randn(5, 2 * 96, generator=g)).to(BF16)
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(BF16)    # exp overflow -> -0, no NaN
    w = (torch.randn(24, 96, generator=g) / 10).to(BF16)
    cfg = FMA if path == "fma" else DOT
    fused = gemv(x, w, act="silu_mul", config=cfg)
    assert torch.equal(fused, gemv(silu_and_mul(x), w, config=cfg))


@interpreted
def test_gemv_rejects_bad_arguments():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="GEMV_MAX_ROWS"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="gate | up"):
        gemv(x, w, act="silu_mul")                        # silu_mul wants [M, 2K]
    with pytest.raises(ValueError, match="act"):
        gemv(x, w, act="gelu")
    with pytest.raises(ValueError, match="act"):
        gemv_ref(x, w, act="relu")
    with pytest.raises(ValueError, match="dtype|bf16"):
        gemv(x.to(BF16), w)
    with pytest.raises(ValueError, match="2-D"):
        gemv(x[0], w)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.randn(7))
    with pytest.raises(ValueError, match="out"):
        gemv(x, w, out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="power of 2"):
        gemv(x, w, config=(24, 32, 1, 1))
    with pytest.raises(ValueError, match="dot"):
        gemv(x, w, config=(8, 32, 1, 1, True))


def test_heuristic_configs(monkeypatch):
    """Hopper heuristic (checked without a GPU): every Llama-3-8B / Qwen3-0.6B shape gets a valid
    config, M = 1 on the FMA path and M >= 2 on tensor cores with one warp per 16 rows, and the
    grid covers 132 SMs twice wherever the minimum block width allows it."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # triton.knobs.runtime.interpret reads it per call
    for N, K in shapes:
        for M in (1, 2, 4, 8):
            c = gemv_config(M, N, K, 132)
            assert c.dot == (M > 1)
            assert K % c.block_k == 0 and c.block_n & (c.block_n - 1) == 0
            if c.dot:
                assert c.num_warps == c.block_n // 16 and c.block_k >= 16
            else:
                assert c.block_n * c.block_k <= 8192       # 64 accumulator registers / thread
            assert -(-N // c.block_n) >= 264 or c.block_n == (16 if c.dot else 8)


# ----------------------------------------------------------------------------------- the layer
def test_linear_on_cpu_is_f_linear_and_never_the_gemv(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("GEMV taken for a CPU tensor")
    monkeypatch.setattr(linear, "gemv", boom)
    g = gen(3)
    layer = Linear(32, {"a": 24, "b": 16}, bias=True)
    layer.weight.data.copy_(torch.randn(40, 32, generator=g))
    layer.bias.data.copy_(torch.randn(40, generator=g))
    x = torch.randn(3, 32, generator=g)
    assert not linear.uses_gemv(x, layer.weight)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    gu = torch.randn(3, 64, generator=g)
    layer.input_act = SiluAndMul()
    assert torch.equal(layer(gu), F.linear(silu_and_mul_ref(gu), layer.weight, layer.bias))
    assert torch.equal(layer(gu[:1]), F.linear(silu_and_mul_ref(gu[:1]), layer.weight, layer.bias))


@interpreted
def test_linear_fuses_its_input_activation_into_the_one_row_gemv(monkeypatch):
    """The GEMV dispatch on CPU tensors through the interpreter: at one row the GEMV computes the
    input activation in its K loop; at more rows the activation runs first, then the plain GEMV."""
    acts = []
    monkeypatch.setattr(linear, "uses_gemv", lambda t, w: True)
    monkeypatch.setattr(linear, "gemv", lambda *a, **kw: acts.append(kw.get("act")) or gemv(*a, **kw))
    g = gen(4)
    down = Linear(48, 40, input_act=SiluAndMul())
    down.weight.data.copy_(torch.randn(40, 48, generator=g) / 7)
    for M in (1, 3):
        gu = torch.randn(M, 96, generator=g)
        torch.testing.assert_close(down(gu), F.linear(silu_and_mul_ref(gu), down.weight), atol=1e-5, rtol=1e-5)
    assert acts == ["silu_mul", None]


def test_llama_mlp_is_down_of_silu_of_gate_up():
    from ridge.layers.mlp import GatedMLP

    mlp = GatedMLP(16, 40)
    g = gen(5)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(4, 16, generator=g)
    expect = F.linear(silu_and_mul_ref(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    assert torch.equal(mlp(x), expect)


# ------------------------------------------------------------------------------ the benchmark
def test_benchmark_plan_and_dry_run(capsys, monkeypatch):
    bg = load_benchmark("gemv")
    monkeypatch.delenv("OUT", raising=False)
    args = bg.parse_args(["--sweep"])
    default, sweep = bg.plan(args)
    assert len(default) == 2 * 6 * 4 and len(sweep) == 5 * 2
    assert {(c["proj"], c["N"], c["K"]) for c in default if c["model"] == "qwen3-0.6b"} == {
        ("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
        ("down+silu", 1024, 3072), ("lm_head", 151936, 1024)}
    assert [c["act"] for c in default if c["proj"] == "down+silu"] == ["silu_mul"] * 8
    n_timings = sum(len(bg.sweep_configs(c["M"])) for c in sweep)
    assert 100 <= n_timings <= 200
    for M in (1, 8):
        for bn, bk, warps, stages, dot in bg.sweep_configs(M):
            assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and stages >= 1
            assert not dot or (bn >= 16 and warps == bn // 16)
            assert dot or M * bn * bk <= 64 * 32 * warps            # FMA accumulator registers
    # weights rotate through > 2x L2; every graph is a multiple of the copies and >= 20 calls
    l2 = 50 << 20
    for n, k in ((1024, 2048), (4096, 4096), (28672, 4096), (128256, 4096)):
        copies = bg.weight_copies(n, k, l2)
        assert copies * n * k * 2 > 2 * l2 and (copies - 1) * n * k * 2 <= 2 * l2
        calls = bg.calls_per_graph(copies, 20)
        assert calls >= 20 and calls % copies == 0
    assert bg.case_bytes(dict(N=4096, K=14336, M=2, act="silu_mul")) == 2 * (4096 * 14336 + 2 * 28672 + 2 * 4096)
    bg.main(["--dry-run", "--sweep", "--models", "qwen3-0.6b", "--rows", "1", "8", "--only", "o", "down+silu"])
    out = capsys.readouterr().out
    assert "4 cases, 4 sweep cases" in out and "down+silu" in out
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    assert bg.parse_args([]).json == "/tmp/somewhere/gemv.json"
    for bad in (["--rows", "9"], ["--only", "nope"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bg.parse_args(bad)


# ------------------------------------------------------------------------------- GPU, real shapes
LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def fresh_generator():
    seed = int.from_bytes(os.urandom(4), "little")   # new inputs every run; printed on failure
    return torch.Generator(device="cuda").manual_seed(seed), seed


def rel_err(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_gpu_gemv_llama8b_shapes(M):
    g, seed = fresh_generator()
    for name, (N, K) in LLAMA8B.items():
        w = (torch.randn(N, K, generator=g, device="cuda") / K**0.5).to(BF16)
        for act in ((None, "silu_mul") if name == "down" else (None,)):
            x = torch.randn(M, 2 * K if act else K, generator=g, device="cuda").to(BF16)
            h = silu_and_mul_ref(x) if act else x
            ref = h.double() @ w.double().T
            for cfg in (None, gemv_config(1, N, K), gemv_config(8, N, K)):   # heuristic, FMA, dot
                y = gemv(x, w, act=act, config=cfg)
                assert rel_err(y, ref) <= 1e-2, f"{name} act={act} M={M} config={cfg} seed {seed}"
            if act:   # fused == unfused kernels, up to silu rounding flips (fp32-ulp exp differences)
                assert rel_err(gemv(x, w, act=act), gemv(silu_and_mul(x), w).double()) <= 1e-2, seed


@pytest.mark.gpu
@needs_gpu
def test_gpu_linear_dispatch_and_cuda_graph(monkeypatch):
    g, seed = fresh_generator()
    calls = []
    monkeypatch.setattr(linear, "gemv", lambda *a, **kw: calls.append(kw.get("act")) or gemv(*a, **kw))
    down = Linear(14336, 4096, input_act=SiluAndMul()).cuda().to(BF16)
    down.weight.data.copy_((torch.randn(4096, 14336, generator=g, device="cuda") / 120).to(BF16))
    for M in (1, 8, 9):
        gu = torch.randn(M, 2 * 14336, generator=g, device="cuda").to(BF16)
        ref = silu_and_mul_ref(gu).double() @ down.weight.double().T
        on = down(gu)
        off = F.linear(silu_and_mul(gu), down.weight)   # cuBLAS, the path before the GEMV
        assert rel_err(on, ref) <= 1e-2 and rel_err(off, ref) <= 1e-2 and rel_err(on, off.double()) <= 1e-2, seed
    # the fused activation at M = 1, silu_and_mul then the plain GEMV at M = 8 (the fused
    # tensor-core path measured slower, see Linear.forward); never the GEMV at M = 9
    assert calls == ["silu_mul", None]
    # captured in a CUDA graph, replayed on new inputs
    x = torch.randn(4, 2 * 14336, device="cuda", dtype=BF16)
    graph, y = capture_cuda_graph(lambda: down(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, silu_and_mul_ref(x).double() @ down.weight.double().T) <= 1e-2
