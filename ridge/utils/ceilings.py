"""The device's ceilings, measured on this machine and cached per device.

  - memory bandwidth: a large device copy, bytes read + written per second. A copy is the
    simplest kernel that streams memory at full rate, so it is the roof a memory-bound kernel
    can actually reach (on an H200 it is ~87% of the datasheet's 4.8 TB/s);
  - matrix throughput for each dtype the device supports: the best of a few large square
    matmuls (cuBLAS on a GPU, oneDNN/MKL on a CPU); fp8 through `torch._scaled_mm` on sm_89+;
  - launch overhead: the time per launch of a trivial kernel issued back to back, as the eager
    engine issues them (on a CPU: per dispatch of a trivial torch op); on a GPU also the time per
    kernel inside a replayed CUDA graph, the floor once launches are captured.

  - the link (tensor parallelism's third roof), for each group size asked for: an all-reduce of
    M bytes on N ranks takes latency + 2(N-1)/N x M / busbw, fitted to timed all-reduces of 8 KB
    to 64 MB (ridge/utils/collectives.py: NCCL between GPUs; on a CPU gloo between processes,
    the backend ridge's CPU ranks use). Measured only where the ranks exist (N GPUs); elsewhere
    `link(N)` gives the assumed NVLink figures below, marked as assumed.

Datasheet values (for a few GPUs) are stored beside the measurements for display only; every
label, fraction and prediction uses the measured numbers.
"""
from __future__ import annotations

import datetime
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ridge.utils.device_cache import cache_root, cached, device_key, device_name, write_json

CACHE_VERSION = 2

# Display only (dense, no sparsity), from the vendors' datasheets: never used in a computation.
DATASHEETS = {
    "NVIDIA H100 80GB HBM3": dict(bandwidth=3.35e12, bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12, fp8=1979e12),
    "NVIDIA H100 PCIe": dict(bandwidth=2.0e12, bf16=756e12, fp16=756e12, tf32=378e12, fp32=51e12, fp8=1513e12),
    "NVIDIA H100 NVL": dict(bandwidth=3.9e12, bf16=835e12, fp16=835e12, tf32=418e12, fp32=60e12, fp8=1671e12),
    "NVIDIA H200": dict(bandwidth=4.8e12, bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12, fp8=1979e12),
    "NVIDIA A100-SXM4-80GB": dict(bandwidth=2.039e12, bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12),
    "NVIDIA A100-SXM4-40GB": dict(bandwidth=1.555e12, bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12),
}

# Assumed where the link was not measured (fewer GPUs than ranks): H100/H200 NVLink through
# NVSwitch, NVLink multicast (NVLS) off as ridge runs it. Bus bandwidth: NCCL's effective NVLink
# rate, ~80% of the 450 GB/s line rate (NCCL's maintainers, NVIDIA/nccl-tests#212; 369 GB/s
# measured on 8 H100s with NVLS off, #309); latency: one 8 KB all-reduce inside ridge's decode
# CUDA graph on 2 H100s (BENCHMARKS.md: 17.6 us a layer for two).
ASSUMED_LINK = dict(latency=8.8e-6, busbw=370e9, kind="NVLink (H100/H200, assumed)", backend="nccl")

# Where a dtype has no measured ceiling, the roof of the dtype its math falls back to.
_FALLBACK = {"fp8": "bf16", "tf32": "fp32", "fp16": "bf16", "bf16": "fp32"}


@dataclass
class Ceilings:
    device: str                       # "cpu" or "cuda"
    name: str                         # the device's name
    key: str                          # cache key: device, capability/threads, torch version
    bandwidth: float                  # bytes/s, read + written, large copy
    matmul: dict[str, float]          # dtype -> FLOP/s
    launch_overhead: float            # s per trivial kernel launched back to back (eager)
    graph_launch: float | None = None  # s per trivial kernel inside a replayed CUDA graph
    details: dict = field(default_factory=dict)
    measured_at: str = ""
    torch_version: str = ""
    datasheet: dict | None = None
    # ranks (as a string: JSON keys) -> the link's measured fit, collectives.measure_link's dict
    links: dict = field(default_factory=dict)

    def link(self, ranks: int) -> "Link":
        """The all-reduce's roof among `ranks` ranks: measured here if it was, else ASSUMED_LINK."""
        m = self.links.get(str(ranks))
        if m is not None:
            return Link(ranks, m["latency"], m["busbw"], m["kind"], m["backend"], True)
        return Link(ranks, ASSUMED_LINK["latency"], ASSUMED_LINK["busbw"], ASSUMED_LINK["kind"],
                    ASSUMED_LINK["backend"], False)

    def roof(self, dtype: str) -> str:
        """The measured ceiling that serves `dtype` (fp32 on a GPU runs on TF32 tensor cores
        when torch allows it; an unmeasured dtype falls back to the one its math runs in)."""
        if dtype == "fp32" and self.device == "cuda" and torch.backends.cuda.matmul.allow_tf32 \
                and "tf32" in self.matmul:
            return "tf32"
        seen = set()
        while dtype not in self.matmul:
            seen.add(dtype)
            dtype = _FALLBACK.get(dtype, "fp32")
            if dtype in seen:
                return max(self.matmul, key=self.matmul.get)
        return dtype

    def peak(self, dtype: str) -> float:
        return self.matmul[self.roof(dtype)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Link:
    """A collective among `ranks` ranks takes latency + link_bytes / busbw (nccl-tests' bus
    bandwidth: link_bytes counted as the ring sends them, ridge/layers/cost.py)."""
    ranks: int
    latency: float          # s a call
    busbw: float            # bytes/s
    kind: str               # "NVLink", "PCIe", "gloo (CPU processes)", ...
    backend: str            # "nccl" or "gloo"
    measured: bool

    def seconds(self, link_bytes: float, calls: int = 1) -> float:
        return calls * self.latency + link_bytes / self.busbw

    def describe(self) -> str:
        how = "measured" if self.measured else "not measured here: assumed"
        return (f"link among {self.ranks} ranks ({self.kind}, {self.backend}, {how}): all-reduce latency "
                f"{self.latency * 1e6:.1f} us, bus bandwidth {self.busbw / 1e9:.0f} GB/s")


# -- timing ----------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(): CUDA events on a GPU, the host clock on a CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


# -- the three measurements ------------------------------------------------------------------------
def _l3_bytes() -> int:
    try:
        root = "/sys/devices/system/cpu/cpu0/cache"
        for idx in os.listdir(root):
            with open(os.path.join(root, idx, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(root, idx, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            return int(text.rstrip("KMG")) * scale
    except OSError:
        pass
    return 0


def measure_bandwidth(device: torch.device, nbytes: int | None = None, reps: int | None = None) -> tuple[float, dict]:
    """Bytes read + written per second by dst.copy_(src). The buffer is far larger than any
    cache on the way (GPU: 1 GiB against a ~50 MB L2; CPU: 256 MiB or twice the L3, so source
    and destination together are 4x the L3), so the copy streams from memory."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else max(256 << 20, 2 * _l3_bytes())
    reps = reps or (20 if device.type == "cuda" else 5)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, reps, warmup=2)
    t = statistics.median(times)
    del src, dst
    return 2 * nbytes / t, dict(buffer_bytes=nbytes, reps=reps, median_s=t, min_s=min(times))


def _matmul_fn(dtype_name: str, n: int, device: torch.device):
    if dtype_name == "fp8":
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()    # column-major, as cuBLASLt wants
        one = torch.ones((), device=device, dtype=torch.float32)

        def fp8(fast: bool):
            return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
        return [("fast_accum", fp8(True)), ("exact_accum", fp8(False))]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}[dtype_name]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return [("", lambda: torch.matmul(a, b, out=c))]


def measure_matmul(device: torch.device, dtype_name: str, sizes=None, reps: int | None = None) -> tuple[float, dict]:
    """Best FLOP/s over large square matmuls (median time at each size). On a GPU the sizes are
    fixed and large enough to fill every SM many times over; on a CPU the size doubles until one
    product takes ~50 ms, so a slow dtype costs little time to measure."""
    results = {}
    cuda = device.type == "cuda"
    reps = reps or (10 if cuda else 3)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    try:
        sizes = sizes or ((4096, 8192, 16384) if cuda and dtype_name in ("bf16", "fp16", "fp8") else
                          (4096, 8192) if cuda else (256, 512, 1024, 2048))
        for n in sizes:
            for variant, fn in _matmul_fn(dtype_name, n, device):
                t = statistics.median(time_fn(fn, device, reps, warmup=2 if cuda else 1))
                results[f"{n}{'-' + variant if variant else ''}"] = 2 * n ** 3 / t
            if not cuda and t > 0.05:
                break
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before
    best = max(results, key=results.get)
    return results[best], dict(best=best, flops_by_size=results, reps=reps)


def measure_launch(device: torch.device, launches: int = 2000) -> tuple[float, float | None, dict]:
    """Per-launch time of a trivial kernel (x += 1 on one element) issued `launches` times back
    to back; on a GPU also per kernel inside a replayed CUDA graph."""
    x = torch.zeros(1, device=device)
    step = lambda: [x.add_(1) for _ in range(launches)]  # noqa: E731
    t = statistics.median(time_fn(step, device, reps=5, warmup=1)) / launches
    graph = None
    if device.type == "cuda":
        per_graph = 100
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(3):
                x.add_(1)
        torch.cuda.current_stream(device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per_graph):
                x.add_(1)
        replays = 20
        graph = statistics.median(time_fn(lambda: [g.replay() for _ in range(replays)], device, reps=5,
                                          warmup=1)) / (replays * per_graph)
    return t, graph, dict(launches=launches, kernel="x.add_(1) on one float32 element")


def supported_dtypes(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["fp32", "bf16"]
    cap = torch.cuda.get_device_capability(device)
    names = ["fp16", "fp32"]
    if cap >= (8, 0):
        names += ["bf16", "tf32"]
    if cap >= (8, 9) and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
        names.append("fp8")
    return names


def measure_ceilings(device: torch.device | str = "cpu", dtypes: list[str] | None = None) -> Ceilings:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bw, bw_info = measure_bandwidth(device)
    matmul, mm_info = {}, {}
    notes = []
    for name in dtypes or supported_dtypes(device):
        try:
            matmul[name], mm_info[name] = measure_matmul(device, name)
        except (RuntimeError, TypeError) as e:      # e.g. a build without fp8 GEMMs
            notes.append(f"{name} matmul not measured: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    launch, graph, launch_info = measure_launch(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()                   # hand the measurement buffers back
    name = device_name(device)
    details = dict(bandwidth=bw_info, matmul=mm_info, launch=launch_info, notes=notes,
                   threads=torch.get_num_threads() if device.type == "cpu" else None)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        details.update(capability=list(torch.cuda.get_device_capability(device)),
                       sm_count=props.multi_processor_count, memory_bytes=props.total_memory)
    return Ceilings(device.type, name, device_key(device), bw, matmul, launch, graph, details,
                    datetime.datetime.now().isoformat(timespec="seconds"), torch.__version__,
                    DATASHEETS.get(name))


def cache_dir() -> str:
    return os.path.join(cache_root(), "roofline")


def cache_path(device: torch.device | str) -> str:
    return os.path.join(cache_dir(), f"ceilings-{device_key(torch.device(device))}.json")


def load_ceilings(device: torch.device | str = "cpu", remeasure: bool = False, ranks: int = 1) -> Ceilings:
    """The device's ceilings from the cache, measured (and cached) on first use or when asked;
    with ranks > 1 also the link among that many ranks, where this machine has them (see
    collectives.link_available), measured once and cached with the rest."""
    from ridge.utils.collectives import link_available, measure_link

    device = torch.device(device)
    path, measure = cache_path(device), lambda: measure_ceilings(device).to_dict()
    try:
        c = Ceilings.from_dict(cached(path, CACHE_VERSION, measure, remeasure))
    except (KeyError, TypeError, ValueError):       # a cache of an older layout: measure again
        logging.getLogger("ridge").warning("cache file %s holds ceilings of another layout: measuring again", path)
        c = Ceilings.from_dict(cached(path, CACHE_VERSION, measure, remeasure=True))
    if ranks > 1 and str(ranks) not in c.links and link_available(device, ranks):
        c.links[str(ranks)] = measure_link(device.type, ranks)
        write_json(path, CACHE_VERSION, c.to_dict())
    return c
