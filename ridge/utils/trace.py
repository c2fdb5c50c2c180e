"""The serving-path trace (`--trace-dir`): what the engine and the server spent their time on, as
it happened, in the Chrome trace format (Perfetto and chrome://tracing open the file).

A stream that waits seconds between two tokens while no step's kernels cost that is almost always
host time: a Triton kernel compiled or autotuned for a shape met for the first time mid-serve, a
garbage collection holding the GIL, the event loop blocked, the engine thread busy with something
that is not a step. A kernel profiler (torch.profiler) sees the device's side and costs too much to
leave on for a long run; these spans cost a few microseconds each, so a whole serve can be traced:
- the engine's steps and their phases (schedule, forward, sample, read back, commit),
- every garbage collection (gc.callbacks), every Triton compile (Triton's jit hooks) and autotune
  benchmark, on whichever thread they ran,
- the server's event loop when it was late to wake (ridge/server/http_server.py),
- a "stall" instant wherever a request's gap between two tokens (as the engine handed them out)
  exceeded 10x the running median gap: `ridge trace FILE` prints each stall with the spans that
  overlapped it (ridge/utils/trace_explain.py).

The tracer is process-wide, as logging is: GC and Triton's hooks are process-wide too. `start` makes
one (the LLM does, given `trace_dir`), `stop` flushes and closes it; `span`, `complete` and `tokens`
do nothing (a shared no-op) when none is running. Events are appended to the file as JSON objects
after a `[` (the trace format's array form, whose closing bracket is optional: a killed process
leaves a readable file, up to the last second's flush).
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import threading
import time
from collections import deque

STALL_FACTOR = 10           # a gap over this many running-median gaps is a stall
_MIN_GAPS = 50              # gaps seen before any is judged (the median needs a sample)
_FLUSH_S = 1.0

_active: Tracer | None = None


def _line(event: dict) -> str:
    return json.dumps(event, separators=(",", ":"), default=str) + ",\n"


def _span_event(name: str, start_us: float, end_us: float, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "X", "ts": round(start_us, 1), "dur": round(end_us - start_us, 1),
            "pid": os.getpid(), "tid": tid, "args": args}


def now_us() -> float:
    return time.perf_counter() * 1e6


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set(self, **args) -> None:
        pass


NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("tracer", "name", "args", "start")

    def __init__(self, tracer: Tracer, name: str, args: dict):
        self.tracer, self.name, self.args = tracer, name, args

    def __enter__(self):
        self.start = now_us()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        self.tracer.complete(self.name, self.start, now_us(), **self.args)
        return False

    def set(self, **args) -> None:
        """Arguments known only inside the span (a step's batch, once scheduled)."""
        self.args.update(args)


class Tracer:
    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"ridge-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
        self._file = open(self.path, "w", buffering=1 << 20)
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._pending: deque = deque()      # events waiting for the file (a collection only appends here)
        self._threads: set[int] = set()
        self._flushed = time.monotonic()
        self._gc_start: dict[int, float] = {}
        self._last: dict[str, float] = {}           # request id -> when it last got tokens (us)
        self._gaps: deque = deque(maxlen=2048)      # the latest gaps, whose median is the running one
        self._num_gaps = 0
        self._median: float | None = None
        self.stalls = 0
        self._write({"name": "process_name", "ph": "M", "pid": os.getpid(), "args": {"name": "ridge"}})
        self._hooks: list = []

    # -- events -------------------------------------------------------------------------------------
    def _write(self, event: dict) -> None:
        self._pending.append(event)
        with self._lock:
            if self._file.closed:
                return
            while self._pending:
                self._file.write(_line(self._pending.popleft()))
            if time.monotonic() - self._flushed > _FLUSH_S:
                self._file.flush()
                self._flushed = time.monotonic()

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._threads:
            self._threads.add(tid)
            self._write({"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid,
                         "args": {"name": threading.current_thread().name}})
        return tid

    def span(self, name: str, **args) -> _Span:
        return _Span(self, name, args)

    def complete(self, name: str, start_us: float, end_us: float, **args) -> None:
        """A span measured by its caller (start and end in now_us's clock)."""
        self._write(_span_event(name, start_us, end_us, self._tid(), args))

    def instant(self, name: str, at_us: float | None = None, **args) -> None:
        self._write({"name": name, "ph": "i", "s": "p", "ts": round(now_us() if at_us is None else at_us, 1),
                     "pid": os.getpid(), "tid": self._tid(), "args": args})

    def tokens(self, requests) -> None:
        """These requests got tokens now: each gap since a request's last tokens joins the running
        median; one over STALL_FACTOR medians is written as a stall (from the last tokens to now)."""
        t = now_us()
        for req in requests:
            rid = req.request_id
            last = self._last.get(rid)
            if req.is_finished:
                self._last.pop(rid, None)
            else:
                self._last[rid] = t
            if last is None:
                continue
            gap = t - last
            self._gaps.append(gap)
            self._num_gaps += 1     # counted apart: the window's length stops growing once full
            if self._num_gaps >= _MIN_GAPS and (self._median is None or self._num_gaps % 128 == 0):
                self._median = statistics.median(self._gaps)
            if self._median is not None and gap > STALL_FACTOR * self._median:
                self.stalls += 1
                self.instant("stall", t, request_id=rid, start_us=round(last, 1), gap_ms=round(gap / 1e3, 3),
                             median_ms=round(self._median / 1e3, 3))

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    # -- process-wide sources: garbage collections, Triton compiles and autotune benchmarks -------
    def _on_gc(self, phase: str, info: dict) -> None:
        # a collection can start inside any allocation, a write of this file's too: it only queues
        # its event, which the next write takes
        tid = threading.get_native_id()
        if phase == "start":
            self._gc_start[tid] = now_us()
        elif tid in self._gc_start:
            self._pending.append(_span_event("gc", self._gc_start.pop(tid), now_us(), tid,
                                             {"generation": info.get("generation"), "collected": info.get("collected")}))

    def _hook(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._hooks.append(lambda: gc.callbacks.remove(self._on_gc))
        try:
            from triton import knobs
            from triton.runtime.autotuner import Autotuner
        except ImportError:         # no Triton (a CPU-only install may lack it): GC and ridge's spans only
            return
        rt, compiling = knobs.runtime, {}

        def before(*, fn=None, **kw):
            compiling[threading.get_native_id()] = now_us()
            return False            # truthy would tell Triton to skip the compile

        def after(*, fn=None, **kw):
            start = compiling.pop(threading.get_native_id(), None)
            if start is not None:
                self.complete("triton compile", start, now_us(), kernel=getattr(fn, "name", str(fn)))

        if rt.jit_cache_hook is None and rt.jit_post_compile_hook is None:
            rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
            self._hooks.append(lambda: (setattr(rt, "jit_cache_hook", None), setattr(rt, "jit_post_compile_hook", None)))
        bench = getattr(Autotuner, "_bench", None)
        if bench is not None:
            def traced_bench(tuner, *args, config, **meta):
                with self.span("triton autotune", kernel=getattr(tuner.fn, "__name__", str(tuner.fn)),
                               config=str(config)):
                    return bench(tuner, *args, config=config, **meta)
            Autotuner._bench = traced_bench
            self._hooks.append(lambda: setattr(Autotuner, "_bench", bench))

    def close(self) -> None:
        for undo in reversed(self._hooks):
            undo()
        self._hooks.clear()
        with self._lock:
            if not self._file.closed:
                while self._pending:
                    self._file.write(_line(self._pending.popleft()))
                self._file.write(json.dumps({"name": "trace_end", "ph": "i", "s": "g", "ts": round(now_us(), 1),
                                             "pid": os.getpid(), "args": {"stalls": self.stalls}}) + "\n]\n")
                self._file.close()


def start(directory: str) -> Tracer:
    """Start the process's tracer (one at a time: a second start while one runs is refused)."""
    global _active
    if _active is not None:
        raise ValueError(f"trace_dir: a trace is already being written ({_active.path})")
    tracer = Tracer(directory)
    tracer._hook()
    _active = tracer
    return tracer


def stop(tracer: Tracer | None) -> None:
    global _active
    if tracer is None:
        return
    if _active is tracer:
        _active = None
    tracer.close()


def active() -> Tracer | None:
    return _active


def span(name: str, **args):
    """A span of the running trace, or a shared no-op: `with trace.span("forward"):`."""
    return NULL_SPAN if _active is None else _Span(_active, name, args)


def tokens(requests) -> None:
    if _active is not None:
        _active.tokens(requests)


def forget(request_id: str) -> None:
    if _active is not None:
        _active.forget(request_id)


async def watch_event_loop(period: float = 0.01, late: float = 0.02) -> None:
    """Run as a task of a server's event loop: while a trace runs, each wake-up later than `late`
    seconds past its `period` is written as an "event loop late" span (the loop was busy: a
    handler's CPU work, a blocking call). Cancel it to stop."""
    while True:
        tracer = _active
        if tracer is None:
            await asyncio.sleep(0.5)
            continue
        due = now_us() + period * 1e6
        await asyncio.sleep(period)
        woke = now_us()
        if woke - due > late * 1e6:
            tracer.complete("event loop late", due, woke, late_ms=round((woke - due) / 1e3, 3))
