import torch, time
from ridge.utils.graph_timing import graph_time_us
from ridge.kernels.moe_gemm import fused_moe_small, SmallTiles
from ridge.layers.moe import quantize_experts_int4
from ridge.kernels.int4_matmul import int4_matmul, pack_int4
from ridge.layers.quant.formats import quantize_rtn, pack_last
torch.manual_seed(0)
dev = "cuda"; dt = torch.bfloat16
t0 = time.time()
E, H, I, k = 64, 2048, 1408, 6
w13 = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(dt)
w2 = (torch.randn(E, H, I, device=dev) * 0.02).to(dt)
q13, q2 = quantize_experts_int4(w13), quantize_experts_int4(w2)
for T in (1, 8):
    x = torch.randn(T, H, device=dev).to(dt)
    ex = torch.rand(T, E, device=dev).topk(k, dim=-1).indices.to(torch.int32)
    wt = torch.rand(T, k, device=dev)
    for name, a, b in (("bf16", w13, w2), ("int4", q13, q2)):
        for tiles in ((SmallTiles(16, 128, 4, 3),) * 2, (SmallTiles(8, 256, 4, 3),) * 2, (SmallTiles(32, 64, 4, 4),) * 2):
            try:
                us = graph_time_us(lambda: fused_moe_small(x, a, b, wt, ex, tiles))
            except Exception as e:
                us = float("nan"); print(e)
            byts = T * k * 3 * I * H * (2 if name == "bf16" else 0.5)
            print(f"moe small T={T} {name} {tiles[0]}: {us:.1f} us, {byts / us / 1e3:.0f} GB/s", flush=True)
print("t", time.time() - t0, flush=True)
for K, N in ((2048, 3072), (2048, 576), (2048, 2048), (2048, 5632), (2816, 2048), (10944, 2048), (2048, 102400)):
    w = (torch.randn(N, K, device=dev) * 0.02).to(dt)
    q, s, z = quantize_rtn(w, 128, scale_dtype=dt)
    qw, sc, zr = pack_int4(q.t()), s.t().contiguous(), z.t().to(dt).contiguous()
    x = torch.randn(1, K, device=dev).to(dt)
    bf = graph_time_us(lambda: x @ w.t())
    i4 = graph_time_us(lambda: int4_matmul(x, qw, sc, zr, 128))
    err = (int4_matmul(x, qw, sc, zr, 128).float() - x.float() @ w.t().float()).abs().max().item()
    print(f"dense K={K} N={N}: bf16 {bf:.1f} us ({N*K*2/bf/1e3:.0f} GB/s), int4 {i4:.1f} us ({N*K/2/i4/1e3:.0f} GB/s) err {err:.3f}", flush=True)
print("t", time.time() - t0, flush=True)
