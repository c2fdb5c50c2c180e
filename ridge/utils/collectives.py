"""The link's ceiling: tensor parallelism's third roof, beside the matrix peak and the memory
bandwidth (ridge/utils/ceilings.py caches it with them).

`measure_link(device_type, N)` starts N ranks (torch.multiprocessing, spawn; rank r on cuda:r),
the backend ridge's own ranks use (NCCL between GPUs, gloo between CPU processes), and times
all-reduces of 8 KB to 64 MB: on GPUs `ITERS` of them captured in one CUDA graph and replayed (a
decode step replays its all-reduces inside its graph, so the launch cost it sees is the graph's;
eager calls if capture fails, said in the result), on a CPU a loop of them on the host clock.
Medians over repetitions, each started from a barrier. Then the fit, weighted so that every size
counts by its relative error:

    t(M) = latency + link_bytes(M) / busbw,     link_bytes(M) = 2(N-1)/N x M   (ring all-reduce)

busbw is nccl-tests' bus bandwidth, which makes the per-rank time of an all-gather (N-1)/N x its
output over the same figure: one fit serves both collectives ridge runs.
"""
from __future__ import annotations

import datetime
import statistics
import subprocess
import time

import numpy as np
import torch

SIZES = tuple(8 << (10 + 2 * i) for i in range(7)) + (64 << 20,)     # 8 KB, 32 KB, ..., 32 MB, 64 MB
CPU_SIZES = SIZES[:6]                                                 # gloo over loopback: up to 8 MB
ITERS, REPS = 20, 10


def link_available(device: torch.device, ranks: int) -> bool:
    """Whether this machine has `ranks` ranks of the device's kind: GPUs, or CPU processes (any)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    return device.type == "cpu"


def link_kind(device_type: str, ranks: int) -> str:
    """What carries the bytes: NVLink where nvidia-smi reports active links on GPU 0, else peer
    to peer (PCIe) or through host memory; on a CPU, gloo between processes (loopback TCP)."""
    if device_type != "cuda":
        return "gloo (CPU processes, loopback)"
    try:
        out = subprocess.run(["nvidia-smi", "nvlink", "--status", "-i", "0"], capture_output=True, text=True,
                             timeout=20).stdout
        if "GB/s" in out:
            return "NVLink"
    except (OSError, subprocess.SubprocessError):
        pass
    return "PCIe (peer to peer)" if torch.cuda.can_device_access_peer(0, 1) else "through host memory"


def fit_link(link_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(latency s, busbw bytes/s) of t = latency + link_bytes / busbw, least squares on the
    relative error (a 8 KB call counts as much as a 64 MB one); latency >= 0."""
    x, t = np.asarray(link_bytes, float), np.asarray(seconds, float)
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    if a < 0:                       # refit through the origin
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if b <= 0:                      # flat times (latency-bound throughout): the best rate seen
        return float(a), float(np.max(x / t))
    return float(a), float(1 / b)


def _time_cuda(x: torch.Tensor, iters: int, reps: int, dist) -> tuple[list[float], str]:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                dist.all_reduce(x)
        run, mode = g.replay, "cuda graph"
    except RuntimeError:
        run, mode = (lambda: [dist.all_reduce(x) for _ in range(iters)]), "eager"
    run()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return times, mode


def _time_cpu(x: torch.Tensor, iters: int, reps: int, dist) -> tuple[list[float], str]:
    dist.all_reduce(x)
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        times.append((time.perf_counter() - t) / iters)
    return times, "host loop"


def _rank(rank: int, ranks: int, port: int, device_type: str, sizes, iters: int, reps: int, queue) -> None:
    import torch.distributed as dist
    try:
        cuda = device_type == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks, store=store,
                                timeout=datetime.timedelta(seconds=120))
        result = {}
        for size in sizes:
            # zeros stay zeros however often they are summed; the element type does not change the bytes
            x = torch.zeros(size // 2, dtype=torch.bfloat16, device=f"cuda:{rank}") if cuda else \
                torch.zeros(size // 4, dtype=torch.float32)
            times, mode = (_time_cuda if cuda else _time_cpu)(x, iters, reps, dist)
            result[size] = (statistics.median(times), mode)
        if rank == 0:
            queue.put(("ok", result))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:          # noqa: BLE001 - the parent names the rank and the error
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def measure_link(device_type: str, ranks: int, sizes=None, iters: int | None = None, reps: int = REPS,
                 timeout_s: float = 300.0) -> dict:
    """Time all-reduces among `ranks` fresh processes and fit the link (the module docstring); the
    dict ceilings.Ceilings.links keeps per group size."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"ranks: a link needs at least 2 ranks, got {ranks}")
    cuda = device_type == "cuda"
    sizes = tuple(sizes or (SIZES if cuda else CPU_SIZES))
    iters = iters or (ITERS if cuda else 3)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, store.port, device_type, sizes, iters, reps, queue), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        status, result = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(30)
        for p in procs:
            if p.is_alive():
                p.terminate()
    if status != "ok":
        raise RuntimeError(f"link measurement among {ranks} ranks failed: {result}")
    link_bytes = [2 * (ranks - 1) / ranks * m for m in sizes]
    seconds = [result[m][0] for m in sizes]
    latency, busbw = fit_link(link_bytes, seconds)
    modes = sorted({result[m][1] for m in sizes})
    return dict(latency=latency, busbw=busbw, kind=link_kind(device_type, ranks), backend="nccl" if cuda else "gloo",
                ranks=ranks, timing=", ".join(modes), iters=iters, reps=reps,
                seconds_by_bytes={str(m): s for m, s in zip(sizes, seconds)},
                measured_at=datetime.datetime.now().isoformat(timespec="seconds"))
