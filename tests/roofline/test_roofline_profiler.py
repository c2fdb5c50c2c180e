"""The roofline's profiled runs leave no kineto marker lines on stderr (fd 2, where kineto's
std::cerr writes), and what else reaches fd 2 while the profiler starts or stops is kept."""
import os
import re

import torch

from ridge.roofline.profiler import markers_dropped, profile

# what kineto prints at a profile's start and stop (USDT ... profiler_start; older: STAGE ...)
MARKER = re.compile(r"^(USDT|STAGE):|profiler_(start|stop)|Completed Stage", re.M)


def test_engine_step_profiled_without_marker_lines(tiny_llm, capfd):
    """The roofline's own measurement of a real decode step on the tiny model (its CPU path runs
    one repetition under torch.profiler to count each op's torch calls)."""
    from ridge.roofline.measure import build_decode, release, time_engine_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    built = build_decode(tiny_llm.engine, 2, 20)
    try:
        capfd.readouterr()
        timing = time_engine_step(tiny_llm.engine, built, reps=1, warmup=0)
        err = capfd.readouterr().err
    finally:
        release(tiny_llm.engine, built)
        torch.set_num_threads(threads)
    assert timing.kernels.get("attention")            # the profiled run happened and counted calls
    assert not MARKER.search(err), err


def test_other_stderr_output_in_the_window_is_kept(capfd):
    capfd.readouterr()
    with markers_dropped():
        os.write(2, b"USDT:2026-11-25 11:50:51 7898:7898 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error from the profiler\n")
        os.write(2, b"STAGE:2026-11-25 11:50:51 7898:7898 ActivityProfilerController.cpp:314] Completed Stage: Warm Up\n")
    with profile([torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).mul_(2)
    err = capfd.readouterr().err
    assert err == "a real error from the profiler\n"
    assert any("mul_" in e.name for e in prof.events())
