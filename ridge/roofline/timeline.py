"""Nested named ranges around the ops of a step, and the timing of a step with them.

An op's time is its *exclusive* time (inclusive minus its timed children), so the op times of a
step never overlap.

  - CPU: ops are synchronous, so the host clock around a range is the op's time. One extra
    repetition under torch.profiler counts the torch calls (dispatches) each op makes.
  - CUDA: the ranges are torch.profiler `record_function` ranges; each kernel is attributed to
    the innermost range that launched it, and an op's time is the sum of its kernels' device
    durations. A kernel launched early by programmatic dependent launch (PDL: ridge's Triton
    kernels let the next kernel start while they finish) counts from the end of the kernel before
    it on its stream: until then it only waits (griddepcontrol.wait), and that time is the earlier
    kernel's, which would otherwise be counted twice (a multi-wave GEMM's last wave showed up as
    hundreds of microseconds of RMSNorm). The whole step is timed without instrumentation, with CUDA events; the step time
    minus the kernels' busy time is launch/idle time (host work, launch gaps, synchronisation).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.autograd.profiler import record_function

from ridge.roofline.profiler import profile

OP_PREFIX = "ridge.op/"
REP_PREFIX = "ridge.rep/"
HOST = "host"          # host-side batch preparation (lists -> device tensors): not a roofline op
# Triton launches its kernels through the driver API (cuLaunchKernelEx), which the profiler does
# not correlate with the Python range that launched them: such kernels arrive as device events
# with no CPU parent. A Triton launch hook logs, for each launch, the kernel's name and the op
# range open on the host; on one stream the k-th device event of a kernel is its k-th launch,
# which ties each event to its op (one kernel may serve several ops, e.g. the GEMV).


class Timeline:
    """Nested named ranges. Modes:
      "clock"   host clock; exclusive times accumulated per label (CPU ops are synchronous);
      "profile" torch.profiler record_function ranges (kernel times are read from the profile);
      "events"  CUDA events, the device drained before each range opens, so a range holds its own
                kernels plus one launch latency (the fallback where the profiler cannot attribute
                kernels); `collect()` turns them into exclusive times;
      "off"     nothing (an uninstrumented run)."""

    def __init__(self, mode: str = "clock"):
        if mode not in ("clock", "profile", "events", "off"):
            raise ValueError(f"timeline mode: {mode!r}")
        self.mode = mode
        self.reset()

    def reset(self) -> None:
        self.stack: list[list] = []
        self.times: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.closed: list[list] = []

    def push(self, label: str) -> None:
        if self.mode == "off":
            return
        self.calls[label] += 1
        if self.mode == "clock":
            self.stack.append([label, time.perf_counter(), 0.0])
        elif self.mode == "profile":
            rf = record_function(OP_PREFIX + label)
            rf.__enter__()
            self.stack.append([label, rf])
        else:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.stack.append([label, start, None, []])

    def pop(self, label: str) -> None:
        if self.mode == "off":
            return
        entry = self.stack.pop()
        if entry[0] != label:
            raise RuntimeError(f"timeline: range {label!r} closed while {entry[0]!r} was open")
        if self.mode == "clock":
            inclusive = time.perf_counter() - entry[1]
            self.times[label] += inclusive - entry[2]
            if self.stack:
                self.stack[-1][2] += inclusive
        elif self.mode == "profile":
            entry[1].__exit__(None, None, None)
        else:
            entry[2] = torch.cuda.Event(enable_timing=True)
            entry[2].record()
            (self.stack[-1][3] if self.stack else self.closed).append(entry)

    def collect(self) -> None:
        """"events" mode: exclusive seconds per label from the recorded events."""
        torch.cuda.synchronize()

        def visit(entry) -> float:
            inclusive = entry[1].elapsed_time(entry[2]) / 1e3
            self.times[entry[0]] += inclusive - sum(visit(child) for child in entry[3])
            return inclusive
        for entry in self.closed:
            visit(entry)
        self.closed = []

    @contextlib.contextmanager
    def range(self, label: str):
        self.push(label)
        try:
            yield
        finally:
            self.pop(label)


@dataclass
class StepTiming:
    step_s: float                         # the step, uninstrumented (median)
    op_s: dict[str, float]                # label -> exclusive time per step (median over reps)
    calls: dict[str, float]               # label -> calls per step
    kernels: dict[str, float | None]      # label -> kernels (GPU) / torch calls (CPU) per step; None: unknown
    other_s: float = 0.0                  # GPU: kernels launched outside every op range
    graph: bool = False                   # the step replays a CUDA graph (its ops timed eagerly)
    step_reps_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def busy_s(self) -> float:
        return sum(self.op_s.values()) + self.other_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def triton_launch_log(tl: Timeline, launches: list[tuple[str, str]]):
    """While open, append (kernel name, innermost open op label or "") for every Triton launch."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    def hook(metadata) -> None:
        launches.append((metadata.data["name"], tl.stack[-1][0] if tl.stack else ""))

    chain = knobs.runtime.launch_enter_hook     # Triton 3.6: a HookChain (other hooks stay in it)
    chain.add(hook)
    try:
        yield
    finally:
        chain.remove(hook)


def _attribute(events, device_times: bool, prof=None, launches=()):
    """Per (rep, label): summed kernel durations (s) and kernel counts when `device_times`, else
    counts of top-level torch calls. Each kernel/call goes to the innermost op range around it."""
    times: dict[tuple[int, str], float] = defaultdict(float)
    counts: dict[tuple[int, str], int] = defaultdict(int)
    if device_times and prof is not None and launches:
        _attribute_uncorrelated(prof, times, counts, launches)
    for evt in events:
        if device_times:
            # GPU-side copies of our own ranges (kineto's gpu_user_annotation) are not kernels
            kernels = [k for k in evt.kernels if not k.name.startswith((OP_PREFIX, REP_PREFIX))]
            if not kernels:
                continue
        elif not evt.name.startswith("aten::"):
            continue
        label, rep, p = None, None, (evt if device_times else evt.cpu_parent)
        nested = False
        while p is not None:
            if p.name.startswith(OP_PREFIX):
                label = label or p.name[len(OP_PREFIX):]
            elif p.name.startswith(REP_PREFIX):
                rep = int(p.name[len(REP_PREFIX):])
                break
            elif not device_times and label is None and p.name.startswith("aten::"):
                nested = True                     # called by another torch op, not by Python
            p = p.cpu_parent
        if rep is None or nested:
            continue
        label = label or ""
        if device_times:
            times[rep, label] += sum(k.duration for k in kernels) / 1e6
            counts[rep, label] += len(kernels)
        else:
            counts[rep, label] += 1
    return times, counts


def _attribute_uncorrelated(prof, times, counts, launches: list[tuple[str, str]]) -> None:
    """Kernels the profiler could not tie to a CPU range (Triton's, see triton_launch_log) are
    dropped from prof.events(), but kineto's raw records keep them: match each kernel's device
    events, in start order, to its logged launches, in launch order, which name the op; the rep
    is the one running on the host when the kernel started (each rep ends with a device sync).
    Each kernel's time starts no earlier than the end of the kernels before it on its stream (PDL:
    module docstring)."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:
        return
    events = list(raw.events())

    def start_ns(e):
        return e.start_ns() if hasattr(e, "start_ns") else e.start_us() * 1000

    def duration_ns(e):
        return e.duration_ns() if hasattr(e, "duration_ns") else e.duration_us() * 1000

    labels: dict[str, deque] = defaultdict(deque)
    for name, label in launches:
        labels[name].append(label)
    reps = sorted((start_ns(e), int(e.name()[len(REP_PREFIX):])) for e in events
                  if e.name().startswith(REP_PREFIX) and str(e.device_type()).endswith("CPU"))
    device_events = sorted((e for e in events if not str(e.device_type()).endswith("CPU")
                            and not e.name().startswith((OP_PREFIX, REP_PREFIX))), key=start_ns)
    stream_end: dict[tuple, int] = {}
    for e in device_events:
        stream = (e.device_index(), e.device_resource_id())
        t, end = start_ns(e), start_ns(e) + duration_ns(e)
        busy_from = max(t, stream_end.get(stream, t))
        stream_end[stream] = max(end, stream_end.get(stream, end))
        if not labels.get(e.name()):
            continue
        label = labels[e.name()].popleft()
        rep = next((r for lo, r in reversed(reps) if lo <= t), None)
        if rep is None or not label:
            continue
        times[rep, label] += max(0, end - busy_from) / 1e9
        counts[rep, label] += 1


def time_step(step_fn: Callable[[Timeline], None], device: torch.device | str, reps: int = 5, warmup: int = 2,
              install: Callable[[Timeline], contextlib.AbstractContextManager] | None = None) -> StepTiming:
    """Time one step, its ops and its launch/idle time.

    `step_fn(tl)` runs one step; it may open ranges itself (`with tl.range("op")`), and/or
    `install(tl)` instruments what it runs (as `instrument_runner` does)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    reps = max(1, reps)
    off = Timeline("off")
    for _ in range(warmup):
        step_fn(off)
    _sync(device)

    install = install or (lambda tl: contextlib.nullcontext())
    op_reps: dict[str, list[float]] = defaultdict(list)
    notes: list[str] = []
    other_s = 0.0
    step_reps = []
    if cuda:
        # 1. the step as it runs (no hooks, no profiler), on the device's clock
        for _ in range(reps):
            _sync(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step_fn(off)
            end.record()
            end.synchronize()
            step_reps.append(start.elapsed_time(end) / 1e3)
        # 2. each op's kernels, under the profiler (kernel durations do not depend on it)
        tl = Timeline("profile")
        launches: list[tuple[str, str]] = []
        with profile([torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            with install(tl), triton_launch_log(tl, launches):
                for r in range(reps):
                    with record_function(f"{REP_PREFIX}{r}"):
                        step_fn(tl)
                    _sync(device)
        times, counts = _attribute(prof.events(), device_times=True, prof=prof, launches=launches)
        labels = {label for _, label in times} | set(tl.calls)
        for label in labels:
            series = [times.get((r, label), 0.0) for r in range(reps)]
            if label:
                op_reps[label] = series
            else:
                other_s = statistics.median(series)
        kernels = {label: sum(counts.get((r, label), 0) for r in range(reps)) / reps for label in labels if label}
        calls = {label: n / reps for label, n in tl.calls.items()}
        missing = [label for label in calls if label != HOST and not kernels.get(label)]
        if missing:
            # Ranges that ran but got no kernels from the profiler (a launcher it cannot
            # correlate): time them with CUDA events instead, and say so.
            etl = Timeline("events")
            series = defaultdict(list)
            with install(etl):
                for _ in range(reps):
                    etl.reset()
                    step_fn(etl)
                    etl.collect()
                    for label in missing:
                        series[label].append(etl.times.get(label, 0.0))
            for label in missing:
                op_reps[label] = series[label]
                kernels[label] = None
            notes.append(f"no kernels attributed by the profiler to {', '.join(sorted(missing))}: timed with "
                         f"CUDA events around each call, the device drained first (includes one launch latency "
                         f"per call; no kernel count)")
    else:
        # The step alone and the step with its op ranges, alternately, so that both see the same
        # machine (a CPU shared with other work drifts between one block of runs and the next).
        tl = Timeline("clock")
        for _ in range(reps):
            t = time.perf_counter()
            step_fn(off)
            step_reps.append(time.perf_counter() - t)
            with install(tl):
                tl.reset()
                step_fn(tl)
            for label, t in tl.times.items():
                op_reps[label].append(t)
        calls = dict(tl.calls)
        # one more run under the profiler, to count the torch calls each op makes
        ptl = Timeline("profile")
        with profile([torch.profiler.ProfilerActivity.CPU]) as prof:
            with install(ptl):
                with record_function(f"{REP_PREFIX}0"):
                    step_fn(ptl)
        _, counts = _attribute(prof.events(), device_times=False)
        kernels = {label: n for (_, label), n in counts.items() if label}
    step_s = statistics.median(step_reps)
    op_s = {label: statistics.median(series + [0.0] * (reps - len(series))) for label, series in op_reps.items()}
    busy = sum(op_s.values()) + other_s
    if busy > step_s:
        # The step and its ops are timed in different repetitions (instrumentation perturbs the
        # step); when the step is busy end to end, medians of the two can cross by noise.
        notes.append(f"step time raised from {step_s * 1e3:.4g} ms to the ops' summed time "
                     f"{busy * 1e3:.4g} ms: the step is busy end to end and the two medians come "
                     f"from different repetitions")
        step_s = busy
    return StepTiming(step_s=step_s, op_s=op_s, calls=calls, kernels=kernels, other_s=other_s,
                      step_reps_s=step_reps, notes=notes)
