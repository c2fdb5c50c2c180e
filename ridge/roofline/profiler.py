"""torch.profiler without kineto's marker lines on stderr.

Kineto (torch.profiler's backend) writes a line such as
`USDT:2026-11-25 11:50:51 7898:7898 SyncActivityProfilerHandler.cpp:52] profiler_start` to the
process's stderr each time a profile starts or stops (older kineto: `STAGE:... Completed Stage`
lines). They are tracing markers for external tools, not messages: torch turns kineto's log down
to errors, but these markers sit above that level, and torch has no setting that reaches them.
Kineto's own switch is an environment variable read once, when the first profile in the process
starts, so it cannot be relied on from inside a library (and would change the process for its
user). So fd 2 is caught only while the profiler starts and stops, the marker lines are dropped
and everything else that arrived there (a real kineto error, a Python warning) is written on.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import torch

# kineto's log line: TYPE:DATE TIME PID:TID FILE:LINE] MESSAGE
KINETO_MARKER = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def markers_dropped():
    """Run the body with fd 2 (where kineto's std::cerr writes) going to a temporary file; then
    restore it and pass on every line that is not a kineto marker."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                caught.seek(0)
                kept = [line for line in caught.read().splitlines(keepends=True) if not KINETO_MARKER.match(line)]
                if kept:
                    os.write(2, b"".join(kept))
    finally:
        os.close(saved)


@contextlib.contextmanager
def profile(activities):
    """`torch.profiler.profile(activities=...)` as a context manager, its start and stop quiet;
    the profiled body itself runs with stderr untouched."""
    prof = torch.profiler.profile(activities=activities)
    with markers_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with markers_dropped():
            prof.__exit__(None, None, None)
