"""EXPERIMENT: int4 GEMM variants at M >= 16 on 8B shapes vs cuBLAS bf16 and the shipped path."""
import json, os, sys, time
import torch, triton
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))
from timing import copies_for, calls_for, time_calls, l2_bytes
from int4_swap import int4_swap
from int4_gemm2 import int4_gemm2
from int4_gemm3 import int4_gemm3
from ridge.kernels.int4_matmul import pack_int4, dequantize_int4, int4_matmul
from ridge.kernels import int4_gemv as gv

DT = torch.bfloat16
G = 128
SHAPES = [(s, int(n), int(k)) for s, n, k in (a.split(":") for a in os.environ.get(
    "SHAPES", "qkv:6144:4096,gate_up:28672:4096,down:4096:14336").split(","))]
ROWS = [int(m) for m in os.environ.get("ROWS", "16,32,64,128,512").split(",")]
SMS = torch.cuda.get_device_properties(0).multi_processor_count
gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
L2 = l2_bytes()


def quant(N, K):
    q = torch.randint(0, 16, (K, N), generator=gen, device="cuda", dtype=torch.int32)
    s = ((torch.rand(K // G, N, generator=gen, device="cuda") + 0.5) * 0.2 / K**0.5).to(DT)
    z = torch.randint(0, 16, (K // G, N), generator=gen, device="cuda").to(DT)
    return pack_int4(q), s, z


def split_for(blocks, k_tiles, resident=2):
    s = 1
    while k_tiles % (2 * s) == 0 and k_tiles // (2 * s) >= 4 and blocks * 2 * s <= resident * SMS:
        s *= 2
    return s


def swap_configs(M, N, K):
    out = []
    bms = sorted({min(max(16, triton.next_power_of_2(M)), 256), min(max(16, triton.next_power_of_2(M)), 128)})
    if M >= 256:
        bms = [128, 256]
    for bm in bms:
        for bn, w in ((64, 4), (128, 4), (128, 8)):
            if bm == 256 and bn == 128 and w == 4:
                continue
            for st in ((3, 4) if bm <= 64 else (3,)):
                blocks = triton.cdiv(N, bn) * triton.cdiv(M, bm)
                sp = split_for(blocks, K // 128)
                out.append(dict(kind="swap", bm=bm, bn=bn, warps=w, stages=st, split=sp))
    return out


def gemm2_configs(M, N, K, kind):
    out = []
    for bm, bn, bk, w, st in ((64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
                              (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)):
        if bm > max(64, triton.next_power_of_2(M)):
            continue
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        sp = 1
        while 2 * sp <= 4 and tiles * sp < SMS and K // (2 * sp) >= 2 * 128:
            sp *= 2
        out.append(dict(kind=kind, bm=bm, bn=bn, bk=bk, warps=w, stages=st, split=sp))
    return out


results = []
t0 = time.time()
for name, N, K in SHAPES:
    for M in ROWS:
        sets = copies_for(N * K // 2, L2)
        calls = calls_for(sets, 20)
        xs = [torch.randn(M, K, generator=gen, device="cuda").to(DT) for _ in range(calls)]
        W = [quant(N, K) for _ in range(sets)]
        ref = xs[0].float() @ dequantize_int4(*W[0], G)
        outs = [torch.empty(M, N, device="cuda", dtype=DT) for _ in range(calls)]
        row = dict(proj=name, N=N, K=K, M=M, t={})
        # bf16 peer
        nb = copies_for(N * K * 2, L2)
        wb = [(torch.randn(N, K, generator=gen, device="cuda") * K**-0.5).to(DT) for _ in range(nb)]
        cb = calls_for(nb, 20)
        xb = (xs * (cb // len(xs) + 1))[:cb]
        row["t"]["bf16"] = time_calls([(lambda i=i: F.linear(xb[i], wb[i % nb])) for i in range(cb)], sets=nb, reps=20).median_us
        del wb
        row["t"]["ship"] = time_calls([(lambda i=i: int4_matmul(xs[i], *W[i % sets], G, out=outs[i])) for i in range(calls)],
                                      sets=sets, reps=20).median_us
        cfgs = gemm2_configs(M, N, K, os.environ.get("VARIANT", "gemm2"))
        if os.environ.get("GEMV") and M <= 128:      # the skinny kernel with a wider BM
            for bm in sorted({32, 64, min(128, max(32, triton.next_power_of_2(M)))}):
                for w in (4, 8):
                    cfgs.append(dict(kind="gemv", bm=bm, bn=128, warps=w, stages=4))
        for c in cfgs:
            key = "{kind} bm{bm} bn{bn} bk{bk} w{warps} s{stages}".format(**{"bk": 128, **c}) + (f" k{c['split']}" if "split" in c else "")
            try:
                if c["kind"] == "gemm3":
                    fn = lambda i: int4_gemm3(xs[i], *W[i % sets], G, outs[i], c["bm"], c["bn"], c["bk"], c["warps"], c["stages"], c["split"])
                elif c["kind"] == "gemm2":
                    fn = lambda i: int4_gemm2(xs[i], *W[i % sets], G, outs[i], c["bm"], c["bn"], c["bk"], c["warps"], c["stages"], c["split"])
                elif c["kind"] == "swap":
                    fn = lambda i: int4_swap(xs[i], *W[i % sets], G, outs[i], c["bm"], c["bn"], 128, c["warps"], c["stages"], c["split"])
                else:
                    m_blocks = triton.cdiv(M, c["bm"])
                    blocks = triton.cdiv(N, 128) * m_blocks
                    sp = gv.split_k_for(blocks, K // 128, M, K, SMS)
                    key += f" k{sp}"

                    def fn(i, c=c, m_blocks=m_blocks, sp=sp):
                        x = xs[i]; qw, s, z = W[i % sets]
                        part = torch.empty((sp, M, N), dtype=torch.float32, device="cuda") if sp > 1 else outs[i]
                        ctr = gv.ticket_counters(x.device) if sp > 1 else outs[i]
                        gv._int4_gemv_kernel[(triton.cdiv(N, 128) * m_blocks, sp)](
                            x, qw, s, z, outs[i], part, ctr, M, N, x.stride(0), outs[i].stride(0), K=K, G=G,
                            M_BLOCKS=m_blocks, BM=c["bm"], BN=128, BK=128, SPLIT_K=sp, TILES=K // 128 // sp,
                            EVEN_K=True, EVEN_N=N % 128 == 0, ROW_SCALES=False, ASM=True, EMULATE_RNE=False,
                            PDL=False, NUM_STAGES=c["stages"], num_warps=c["warps"], num_stages=c["stages"])
                        return outs[i]
                y = fn(0).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    row["t"][key] = f"WRONG {err:.2e}"
                    continue
                row["t"][key] = time_calls([(lambda i=i: fn(i)) for i in range(calls)], sets=sets, reps=20).median_us
            except Exception as e:  # noqa
                row["t"][key] = f"ERR {type(e).__name__}: {str(e)[:120]}"
        tb = row["t"]["bf16"]
        timed = {k: v for k, v in row["t"].items() if isinstance(v, float) and k not in ("bf16",)}
        best = min(timed, key=timed.get)
        row["best"] = best
        print(f"{name:8} M={M:4}  bf16 {tb:7.1f}us  ship {row['t']['ship']:7.1f} ({tb / row['t']['ship']:.2f}x)  "
              f"best {best} {timed[best]:7.1f} ({tb / timed[best]:.2f}x)  [{time.time() - t0:.0f}s]", flush=True)
        results.append(row)
        del xs, W, outs
        torch.cuda.empty_cache()
        json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
