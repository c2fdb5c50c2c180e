"""Timing a GPU function the way a decode step runs it: replayed from a CUDA graph (the FP8 and INT4
GEMM dispatches and the MoE kernel plans use it to choose between paths)."""
from __future__ import annotations

import statistics

import torch


def error_line(e: BaseException) -> str:
    """How a dispatch table records a path that failed to time: the error's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _eager_us(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def graph_time_us(fn, reps: int = 7, calls: int = 10, bound_us: float = float("inf")) -> float:
    """Median over reps of the time per call of `calls` calls replayed from one CUDA graph, after
    warm-up: decode steps replay their GEMMs from graphs, so a path's host launch cost (two launches
    and TMA descriptors for the FP8 paths, one for bf16) must not decide a small batch's choice.
    A path that cannot be captured is timed eagerly.

    A call of a millisecond or more replays fewer times (a replay of ~2 ms is long enough to time);
    with bound_us (the best candidate's time so far) a call whose eager time is over 4x the bound
    plus 50 us (room for its launch cost) is not timed further: it cannot be the choice, and the
    slowest tiles of a large batch are what made a tuning pass take minutes."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    eager = _eager_us(fn)
    if eager > 4 * bound_us + 50:
        return eager
    calls = max(1, min(calls, int(2000 / max(eager, 1.0))))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError:
        graph, run = None, lambda: [fn() for _ in range(calls)]     # noqa: E731
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
