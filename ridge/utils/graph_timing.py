"""Timing GPU work the way a decode step runs it: replayed from a CUDA graph. The one timer of ridge:
the FP8 and INT4 GEMM dispatches and the MoE kernel plans choose between paths with
`graph_time_us`, and the kernel benchmarks (benchmarks/timing.py) capture and time their calls
with `warm_up`, `capture` and `elapsed_ms`."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


def error_line(e: BaseException, width: int = 160) -> str:
    """How a dispatch table or a benchmark's report records a path that failed to time: the error's
    type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:width] if str(e) else ''}"


def elapsed_ms(run: Callable[[], object]) -> float:
    """GPU time of one run() between a pair of CUDA events on the current stream, in milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def warm_up(fns: Sequence[Callable[[], object]]) -> None:
    """Each call once on a side stream, as capture wants: Triton compiles and autotunes and the
    libraries pick their kernels here, outside the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fns: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """The calls, back to back, captured into one CUDA graph (warm them up first). A call that
    cannot be captured raises (RuntimeError): the caller times it eagerly instead."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


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
    eager = elapsed_ms(fn) * 1e3
    if eager > 4 * bound_us + 50:
        return eager
    calls = max(1, min(calls, int(2000 / max(eager, 1.0))))
    try:
        run = capture([fn] * calls).replay
    except RuntimeError:
        run = lambda: [fn() for _ in range(calls)]     # noqa: E731
    return statistics.median(elapsed_ms(run) * 1e3 / calls for _ in range(reps))
