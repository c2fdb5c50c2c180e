"""The serving-path trace (ridge/utils/trace.py, `trace_dir`): a gap between two tokens that a
slow step, a garbage collection or a blocked event loop caused is recorded as a stall, and
`ridge trace` names what overlapped it; the file is the Chrome trace format, readable when closed
and when its process died before closing it; the process-wide hooks (GC, Triton) go when the
trace stops; with no trace running, every call is a no-op."""
from __future__ import annotations

import asyncio
import gc
import glob
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.cli import main
from ridge.utils import trace
from ridge.utils.trace_explain import explain, format_explained, load


def one_trace(directory) -> str:
    (path,) = glob.glob(str(directory / "*.json"))
    return path


def req(rid: str, finished: bool = False):
    return SimpleNamespace(request_id=rid, is_finished=finished)


@pytest.fixture
def tracer(tmp_path):
    t = trace.start(str(tmp_path))
    yield t
    trace.stop(t)


def test_a_gap_over_ten_medians_is_a_stall_named_by_what_overlapped_it(tracer, tmp_path):
    for _ in range(60):                     # 60 steps of two requests, 2 ms apart
        with trace.span("step"):
            time.sleep(0.002)
        trace.tokens([req("a"), req("b")])
    with trace.span("step"), trace.span("forward", note="slow"):
        time.sleep(0.1)                     # ~50 medians
    trace.tokens([req("a"), req("b", finished=True)])
    trace.tokens([req("a")])                # a fast gap again: no stall
    trace.stop(tracer)
    (stall,) = explain(load(one_trace(tmp_path)))
    assert stall["request_ids"] == ["a", "b"] and stall["gap_ms"] >= 100 and stall["median_ms"] < 10
    top = {r["name"]: r for r in stall["spans"]}
    assert top["forward"]["overlap_ms"] >= 95 and top["forward"]["args"] == {"note": "slow"}
    assert "forward" in format_explained([stall])


def test_a_request_finished_or_aborted_is_forgotten(tracer):
    trace.tokens([req("a"), req("b")])
    trace.tokens([req("a", finished=True)])
    trace.forget("b")
    assert tracer._last == {}


def test_collections_are_traced_and_the_hooks_go_with_the_trace(tmp_path):
    t = trace.start(str(tmp_path))
    with pytest.raises(ValueError, match="trace_dir: a trace is already being written"):
        trace.start(str(tmp_path))
    gc.collect()
    trace.stop(t)
    assert t._on_gc not in gc.callbacks and trace.active() is None
    try:
        from triton import knobs
        assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
    except ImportError:
        pass
    events = json.load(open(one_trace(tmp_path)))      # closed: strict JSON
    assert any(e["name"] == "gc" and e["ph"] == "X" and e["args"]["generation"] == 2 for e in events)
    assert events[-1]["name"] == "trace_end"


def test_a_trace_left_open_by_a_dead_process_still_reads(tracer, tmp_path):
    with trace.span("step"):
        pass
    tracer._file.flush()                    # what the periodic flush leaves on disk; no closing bracket
    assert [e["name"] for e in load(tracer.path) if e["ph"] == "X"] == ["step"]


def test_a_late_event_loop_is_a_span(tracer, tmp_path):
    async def blocked():
        watch = asyncio.create_task(trace.watch_event_loop())
        await asyncio.sleep(0.05)
        time.sleep(0.2)                     # a handler blocking the loop
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(blocked())
    trace.stop(tracer)
    late = [e for e in load(one_trace(tmp_path)) if e["name"] == "event loop late"]
    assert len(late) == 1 and late[0]["args"]["late_ms"] >= 150


def test_without_a_trace_every_call_is_a_no_op():
    assert trace.active() is None
    assert trace.span("step") is trace.NULL_SPAN
    trace.tokens([req("a")])
    trace.forget("a")


def test_bad_trace_files_are_named(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert main(["trace", str(tmp_path / "x.json")]) == 2
    assert "not a trace in the Chrome trace format" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_an_engine_with_trace_dir_traces_its_steps_and_its_stall(tmp_path, capsys):
    """The engine's own trace: a step made slow by a patched runner is the stall's explanation."""
    with LLM(demo_model_path(), device="cpu", show_progress=False, kv_cache_memory=8 << 20,
             trace_dir=str(tmp_path)) as llm:
        execute, calls = llm.engine.runner.execute, []

        def slow_at_the_40th(sched):
            calls.append(1)
            if len(calls) == 40:
                time.sleep(1.0)
            return execute(sched)

        llm.engine.runner.execute = slow_at_the_40th
        llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
        assert trace.active() is not None
    assert trace.active() is None           # closing the LLM closed its trace
    path = one_trace(tmp_path)
    names = {e["name"] for e in load(path)}
    assert {"load model", "step", "schedule", "forward", "sample", "read back"} <= names
    (stall,) = explain(load(path))
    assert len(stall["request_ids"]) == 2 and stall["gap_ms"] >= 1000
    forward = next(r for r in stall["spans"] if r["name"] == "forward")
    assert forward["overlap_ms"] >= 990 and forward["thread"] == "MainThread"
    assert main(["trace", path]) == 0
    assert "waited up to" in capsys.readouterr().out


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])
@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@pytest.mark.gpu
def test_gpu_triton_compiles_and_autotuning_are_spans(tracer, tmp_path):
    x = torch.randn(1000 + os.getpid() % 97, device="cuda")     # a key no earlier run tuned
    _add_one[lambda m: (triton.cdiv(x.numel(), m["BLOCK"]),)](x, x.numel())
    torch.cuda.synchronize()
    trace.stop(tracer)
    events = load(one_trace(tmp_path))
    compiles = [e for e in events if e["name"] == "triton compile"]
    tunes = [e for e in events if e["name"] == "triton autotune"]
    assert compiles and all(e["args"]["kernel"] == "_add_one" for e in compiles)
    assert len(tunes) == 2 and {e["args"]["kernel"] for e in tunes} == {"_add_one"}
