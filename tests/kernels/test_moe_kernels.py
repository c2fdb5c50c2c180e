"""The mixture-of-experts kernels (ridge/kernels/moe_route.py, moe_gemm.py) against their torch
references in Triton's interpreter at ragged expert loads: routing, the expert-sorted alignment, the
small and grouped expert GEMMs in float, FP8 and INT4, and the shapes they refuse. (The engine with
MoE models: tests/models/test_moe.py.)"""
import pytest
import torch
import triton

from ridge.kernels.moe_gemm import (SMALL_MAX_TOKENS, GroupedTiles, SmallTiles, fused_moe_grouped, fused_moe_ref,
                                    fused_moe_small)
from ridge.kernels.moe_route import align_by_expert, align_by_expert_ref, max_blocks, route_topk, route_topk_ref

interpret = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="Triton kernels on a CPU need TRITON_INTERPRET=1")


def _loads(T, E, k, kind, gen):
    """Expert choices [T, k] (distinct per token) with a given load pattern."""
    if kind == "uniform":
        return torch.rand(T, E, generator=gen).topk(k, dim=-1).indices.int()
    if kind == "hot":          # expert 1 in every token (it takes all T), the rest spread over E // 2
        rest = torch.rand(T, E // 2, generator=gen)
        rest[:, 1] = -1.0
        return torch.cat([torch.ones(T, 1, dtype=torch.int64), rest.topk(k - 1, dim=-1).indices], 1).int()
    if kind == "one":          # the same k experts for every token: all other experts get 0 rows
        return torch.arange(k).repeat(T, 1).int() + 2
    raise ValueError(kind)


@interpret
@pytest.mark.parametrize("T,E,k,renorm", [(1, 8, 2, True), (7, 128, 8, False), (33, 60, 6, True), (4, 16, 1, False)])
def test_route_topk_matches_reference(T, E, k, renorm):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
    w, e = route_topk(logits, k, renorm)
    wr, er = route_topk_ref(logits, k, renorm)
    assert torch.equal(e, er)
    torch.testing.assert_close(w, wr, atol=1e-6, rtol=1e-6)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(T))


@interpret
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (24, 8, 2, 16), (40, 16, 4, 32), (130, 64, 8, 16)])
def test_align_by_expert_matches_reference(T, E, k, bm, kind):
    experts = _loads(T, E, k, kind, torch.Generator().manual_seed(T + E))
    got, ref = align_by_expert(experts, E, bm), align_by_expert_ref(experts, E, bm)
    for g, r, name in zip(got, ref, ("pair_order", "block_expert", "expert_counts")):
        assert torch.equal(g, r), name
    order, blocks, counts = got
    P = T * k
    assert order.numel() == max_blocks(P, E, bm) * bm
    assert sorted(order[order < P].tolist()) == list(range(P))         # every pair once
    for b, e in enumerate(blocks.tolist()):                              # each tile holds one expert's pairs
        rows = order[b * bm:(b + 1) * bm]
        rows = rows[rows < P].long()
        assert e >= 0 or rows.numel() == 0
        assert (experts.reshape(-1)[rows] == e).all()
    assert counts.tolist() == torch.bincount(experts.reshape(-1).long(), minlength=E).tolist()


@pytest.mark.slow
@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 16, 4), (40, 8, 2)])
def test_expert_kernels_match_reference(T, E, k, kind, dtype):
    g = torch.Generator().manual_seed(7 * T + E)
    H, inter = 64, 48
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.2).to(dtype)
    experts = _loads(T, E, k, kind, g)
    weights = torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # tiles 32 wide: two N tiles in every GEMM (gate/up's second a ragged 16 of 32) and two or three K
    # tiles (down's last ragged at k = 2): few programs, each running the same code as at any tile size
    if T <= SMALL_MAX_TOKENS:       # the small path serves only these; a program is one pair / token
        small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(32, 32, 4, 1), SmallTiles(32, 64, 4, 1)))
        torch.testing.assert_close(small.float(), ref, **tol)
    for bm, fuse_sum in ((16, True), (32, True), (16, False)):
        grouped = fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(bm, 32, 32, 4, 1),) * 2, fuse_sum)
        torch.testing.assert_close(grouped.float(), ref, **tol)


@pytest.mark.slow
@interpret
@pytest.mark.parametrize("T,k", [(3, 2), (12, 2)])
def test_fp8_expert_kernels_match_the_dequantized_reference(T, k):
    """Weight-only FP8 experts: K (160) and 2I (288) ragged against the 128 x 128 scale blocks, and
    a block straddling an expert's gate and up rows."""
    from ridge.layers.quant.fp8.experts import quantize_experts
    g = torch.Generator().manual_seed(3 + T)
    E, H, inter = 8, 160, 144
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = quantize_experts((torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(torch.bfloat16))
    w2 = quantize_experts((torch.randn(E, H, inter, generator=g) * 0.2).to(torch.bfloat16))
    assert w13.q.dtype == torch.float8_e4m3fn and w13.scale.shape == (E, 3, 2)
    experts, weights = _loads(T, E, k, "uniform", g), torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    # gate/up 64 x 64 tiles: three N tiles (the last ragged), three K tiles (the last ragged, two a scale
    # block), up tiles whose rows straddle scale blocks 1 and 2; down 128 wide: two N tiles (the second
    # ragged, in row block 1) and three K tiles of 64 (the last ragged, two a scale block)
    small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(64, 64, 4, 1), SmallTiles(128, 128, 4, 1)))
    torch.testing.assert_close(small.float(), ref, atol=2e-2, rtol=2e-2)
    grouped = fused_moe_grouped(x, w13, w2, weights, experts,
                                (GroupedTiles(16, 64, 64, 4, 1), GroupedTiles(16, 128, 64, 4, 1)))
    torch.testing.assert_close(grouped.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="divides 128"):
        fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 256, 4, 1),) * 2)


def _int4_fp32(w):
    """Int4Experts dequantized in fp32, unrounded: (q - z) * s."""
    from ridge.kernels.int4_matmul import dequantize_int4
    return torch.stack([dequantize_int4(q.T, s.T.float(), z.T.float(), 128).T for q, s, z in zip(w.q, w.scale, w.zero)])


@pytest.mark.slow
@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,k", [(3, 2), (24, 2)])
def test_int4_expert_kernels_match_the_dequantized_reference(T, k, kind, dtype):
    """INT4 experts (codes packed along K, a scale and zero point per 128 inputs): K of gate/up 160
    (a short last group), I = 72 (down's K one short group; I ragged against the 64-row tiles);
    uniform load, one expert taking every token, experts with none."""
    from ridge.kernels.moe_gemm import Int4Experts, dequantize_experts
    from ridge.layers.quant.int4.experts import quantize_experts_int4
    g = torch.Generator().manual_seed(5 + T)
    E, H, inter = 8, 160, 72
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = quantize_experts_int4((torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(dtype))
    w2 = quantize_experts_int4((torch.randn(E, H, inter, generator=g) * 0.2).to(dtype))
    assert isinstance(w13, Int4Experts) and w13.q.shape == (E, 2 * inter, H // 8) and w13.scale.shape == (E, 144, 2)
    assert w13.shape == (E, 2 * inter, H) and w2.zero.dtype == dtype
    experts, weights = _loads(T, E, k, kind, g), torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    # the reference is the dequantized experts' float MoE
    assert torch.equal(ref, fused_moe_ref(x, dequantize_experts(w13), dequantize_experts(w2), weights, experts).float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if T <= 16:          # the small path serves only steps of <= SMALL_MAX_TOKENS (16) tokens
        # gate/up 64 x 64 tiles: two N tiles (the second 8 of 64) and three K tiles (groups 0, 0, 1, the
        # last half a tile); down 128 x 128: two N tiles (the second ragged) and two K tiles of 64 (the
        # second 8 wide)
        small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(64, 64, 4, 1), SmallTiles(128, 128, 4, 1)))
        # the small path scales each group's fp32 sums (ridge/kernels/moe_int4.py) instead of rounding
        # every dequantized weight to the activation dtype: in bf16 it is held to the unrounded dequantized
        # MoE in fp32, no farther from it than twice the reference (whose rounded weights put it ~1 ulp off)
        # (gate/up with 128-wide K tiles runs on tensor cores: checked too, its second tile a short one)
        small_mma = fused_moe_small(x, w13, w2, weights, experts,
                                    (SmallTiles(64, 128, 4, 1), SmallTiles(128, 128, 4, 1)))
        exact = fused_moe_ref(x.float(), _int4_fp32(w13), _int4_fp32(w2), weights, experts)
        for got in (small, small_mma):
            if dtype == torch.float32:
                torch.testing.assert_close(got.float(), ref, **tol)
            else:
                assert (got.float() - exact).abs().max() <= 2 * (ref - exact).abs().max()
    # the grouped path: the generic tile loads (64-wide K: two tiles a group) and the nibble planes (one
    # 128-wide group a K step, each weight rounded as the reference's), both held to the reference;
    # gate/up tiles 64 wide, down's 128 (two N tiles each, the second ragged)
    for bm, bk, fuse_sum in ((16, 64, True), (32, 64, False), (16, 128, True), (32, 128, False)):
        tiles = (GroupedTiles(bm, 64, bk, 4, 1), GroupedTiles(bm, 128, bk, 4, 1))
        grouped = fused_moe_grouped(x, w13, w2, weights, experts, tiles, fuse_sum)
        torch.testing.assert_close(grouped.float(), ref, **tol)
    with pytest.raises(ValueError, match="Int4Experts need tiles whose K width divides 128"):
        fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(16, 32, 256, 4, 1),) * 2)


def test_expert_kernels_refuse_mismatched_shapes():
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 5)
    e, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_small(x, w13, w2, w, e)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_grouped(x, w13, torch.randn(4, 8, 6), w, e, (GroupedTiles(16, 16, 32, 4, 1), GroupedTiles(32, 16, 32, 4, 1)))
