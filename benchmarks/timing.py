"""The one timing helper of ridge's kernel benchmarks: CUDA-graph replays over rotating inputs.

    sets = rotating_sets(make_set, bytes_per_set)        # together > 2x L2, fresh random values
    t = time_rotating(lambda s: kernel(s["x"], s["w"], out=s["y"]), sets)
    t.median_us                                          # per call, median over the replays

Why this shape:
  * A decode step runs its kernels from a CUDA graph, so a kernel is timed as the engine runs it:
    `calls` back-to-back calls are captured once into one graph, the graph is replayed `reps`
    times after `warmup` untimed replays, each replay bracketed by a pair of CUDA events; the
    time per call is replay time / calls, and the reported figure is the median over replays
    (min, max and the relative spread beside it). Launch gaps inside a graph cost what they cost
    in a decode step; host launch overhead does not enter.
  * A weight or input that fits in L2 would be read from L2 on the next replay, which the engine
    never sees (a decode step streams every weight from HBM once). The calls therefore rotate
    through several input sets whose total size exceeds twice the L2 (`copies_for`), every set
    drawn from fresh random values (zeros can run faster than real data and hide unwritten
    outputs); the number of calls is a multiple of the sets, so every set is re-used at the same
    distance on every replay.
  * A callable that cannot be captured (a peer that synchronises, or a compiled function with its
    own graphs) is timed eagerly between the same event pairs, and the result says so (`mode`).

The replay clock is injectable (`Replayer`), so the median / rotation logic is tested on the CPU
with a fake clock (tests/benchmarks/test_benchmark_scripts.py).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

DEFAULT_L2_BYTES = 50 << 20      # used only when the device does not report its L2 size


def json_option(ap, filename: str, without_out: str | None = None) -> None:
    """A script's --json: by default $OUT/<filename> when OUT is set (the device machine sets it;
    benchmarks/run.py passes --json itself), else `without_out`."""
    out_dir = os.environ.get("OUT")
    ap.add_argument("--json", default=os.path.join(out_dir, filename) if out_dir else without_out)


def replay_options(ap, reps: int = 20) -> None:
    """A script's --calls (calls captured per graph, at least) and --reps (timed replays, median)."""
    ap.add_argument("--calls", type=int, default=20, help="calls captured per graph (at least)")
    ap.add_argument("--reps", type=int, default=reps, help="graph replays timed (median)")


def parse_positive(ap, argv, sizes: str):
    """ap.parse_args(argv), refusing any value of --<sizes>, --calls or --reps below 1."""
    args = ap.parse_args(argv)
    if any(v < 1 for v in getattr(args, sizes)) or args.calls < 1 or args.reps < 1:
        ap.error(f"--{sizes}, --calls and --reps must be positive")
    return args


def write_json(path: str, result: dict) -> None:
    """`result` as indented JSON at `path`, its folder made first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


@dataclass(frozen=True)
class Timing:
    """Per-call time of one measurement (microseconds), from `reps` timed replays."""
    median_us: float
    min_us: float
    max_us: float
    reps: int
    calls: int              # calls per replay (captured in one graph, or run eagerly)
    sets: int               # distinct input sets the calls rotate through
    mode: str               # "graph" or "eager"

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the replays were."""
        return (self.max_us - self.min_us) / self.median_us if self.median_us else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "spread": self.spread}


def copies_for(bytes_per_set: int, l2_bytes: int) -> int:
    """The fewest sets whose total size exceeds twice the L2 (1 if one set already does)."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    return 2 * l2_bytes // bytes_per_set + 1


def calls_for(sets: int, min_calls: int) -> int:
    """Calls per replay: at least min_calls, a multiple of the sets."""
    return sets * max(1, math.ceil(min_calls / sets))


def summarize(replay_ms: Sequence[float], calls: int, sets: int, mode: str) -> Timing:
    """Per-call statistics of timed replays (each `calls` calls long), in microseconds."""
    if not replay_ms:
        raise ValueError("no timed replays")
    per_call = [ms * 1e3 / calls for ms in replay_ms]
    return Timing(statistics.median(per_call), min(per_call), max(per_call), len(per_call), calls, sets, mode)


class Replayer:
    """Captures a list of calls into one CUDA graph and times each replay with CUDA events: ridge's
    own timer (ridge.utils.graph_timing), the one the GEMM dispatches choose their paths with."""

    def __init__(self):
        from ridge.utils import graph_timing
        self.timer = graph_timing

    def prepare(self, fns: Sequence[Callable[[], object]], graph: bool) -> Callable[[], None]:
        self.timer.warm_up(fns)
        if not graph:
            def run_all():
                for f in fns:
                    f()
            return run_all
        self._graph = self.timer.capture(fns)       # kept alive as long as the replayer
        return self._graph.replay

    def time_ms(self, run: Callable[[], None]) -> float:
        return self.timer.elapsed_ms(run)


def time_calls(fns: Sequence[Callable[[], object]], *, sets: int = 1, reps: int = 30, warmup: int = 3,
               graph: bool = True, replayer=None) -> Timing:
    """Time one replay of all `fns` (back to back), `reps` times after `warmup`; per-call median."""
    if not fns or reps < 1 or warmup < 0:
        raise ValueError("time_calls: need calls, reps >= 1 and warmup >= 0")
    rp = replayer if replayer is not None else Replayer()
    run = rp.prepare(fns, graph)
    for _ in range(warmup):
        rp.time_ms(run)
    times = [rp.time_ms(run) for _ in range(reps)]
    return summarize(times, len(fns), sets, "graph" if graph else "eager")


def time_rotating(fn: Callable[[object], object], sets: Sequence[object], *, min_calls: int = 20,
                  reps: int = 30, warmup: int = 3, graph: bool = True, replayer=None) -> Timing:
    """Time fn(set) with the calls rotating through `sets` (call i uses sets[i % len(sets)])."""
    if not sets:
        raise ValueError("time_rotating: no input sets")
    n = calls_for(len(sets), min_calls)
    fns = [(lambda s=sets[i % len(sets)]: fn(s)) for i in range(n)]
    return time_calls(fns, sets=len(sets), reps=reps, warmup=warmup, graph=graph, replayer=replayer)


def l2_bytes(device=None) -> int:
    """The device's L2 size (DEFAULT_L2_BYTES where it is not reported)."""
    import torch
    props = torch.cuda.get_device_properties(device if device is not None else 0)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def rotating_sets(make_set: Callable[[], object], bytes_per_set: int, l2: int | None = None,
                  max_sets: int = 100_000) -> list:
    """Enough sets from make_set() (each drawn fresh) that together they exceed 2x L2."""
    n = copies_for(bytes_per_set, l2 if l2 is not None else l2_bytes())
    if n > max_sets:
        raise ValueError(f"{n} input sets of {bytes_per_set} bytes needed to exceed 2x L2; raise max_sets")
    return [make_set() for _ in range(n)]


def copy_bandwidth_gbps() -> float:
    """The measured HBM ceiling, GB/s read + written by a large device copy (ridge.roofline's own
    measurement): every benchmark's fraction of the ceiling divides by this."""
    import torch

    from ridge.utils.ceilings import measure_bandwidth
    return measure_bandwidth(torch.device("cuda"))[0] / 1e9


def short_error(e: BaseException, width: int = 160) -> str:
    """An exception as one line for a benchmark's report: its type and its message's first line."""
    from ridge.utils.graph_timing import error_line
    return error_line(e, width)


def try_time(name: str, timer: Callable[[], Timing]) -> Timing | None:
    """Run a timing; a peer that fails (a missing backend) reports n/a instead of ending the run."""
    try:
        return timer()
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: n/a ({short_error(e)})", flush=True)
        return None


def record_bandwidth(res: dict, name: str, t: Timing | None, nbytes: float, copy_gbps: float) -> None:
    """Put one timed variant's figures into a result row: `<name>_timing`, `_us`, `_GBps` (nbytes
    over the median) and `_frac_copy_bw` (of the measured copy bandwidth); None where it failed."""
    res[f"{name}_timing"] = t and t.as_dict()
    res[f"{name}_us"] = t and t.median_us
    res[f"{name}_GBps"] = t and nbytes / (t.median_us * 1e-6) / 1e9
    res[f"{name}_frac_copy_bw"] = t and res[f"{name}_GBps"] / copy_gbps


def cuda_run(script: str, cpu_tests: str):
    """The start of a kernel benchmark's GPU run: without CUDA, exit pointing at the CPU checks;
    else (seed, a CUDA generator seeded with it, the L2 size) for the run's fresh random inputs."""
    import os
    import sys

    import torch
    if not torch.cuda.is_available():
        sys.exit(f"benchmarks/{script} needs a CUDA GPU (--dry-run prints the plan; the kernels' CPU checks are "
                 f"{cpu_tests} under TRITON_INTERPRET=1)")
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator(device="cuda").manual_seed(seed), l2_bytes()


def print_plan(plan: list[dict], describe: Callable[[dict], str]) -> None:
    """--dry-run: the number of cases, then one line per case."""
    print(f"{len(plan)} cases")
    for c in plan:
        print("  " + describe(c))


def run_plan(plan: list[dict], run_case: Callable[[dict], dict], result: dict, verdicts: Callable[[list], dict],
             json_path: str | None) -> dict:
    """Each case in turn (freeing the allocator's cache between them), then the verdicts and the
    wall time into `result`, written as JSON to json_path when given."""
    import time

    import torch
    t0 = time.perf_counter()
    for c in plan:
        print(f"{c['model']} {c['proj']} M={c['M']} ...", flush=True)
        result["rows"].append(run_case(c))
        torch.cuda.empty_cache()
    result["verdicts"] = verdicts(result["rows"])
    result["wall_s"] = time.perf_counter() - t0
    if json_path:
        write_json(json_path, result)
    return result
