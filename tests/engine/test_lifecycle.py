"""Building, using and giving back an engine five times in one process leaves the process where the
first build left it: resident memory within RSS_TOLERANCE (a small fraction of what one live demo
engine holds, so one engine kept alive would show) and not one thread more, whether each LLM is
closed or only dropped (and collected). On a GPU, torch.cuda.memory_reserved and memory_allocated
return to their baseline after close and after a drop. (That a dropped LLM frees its memory without
a collection at all is tests/engine/test_llm_close.py's.)"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["def add(a, b):", "import os\n"]
BUILDS = 5
RSS_TOLERANCE = 8 << 20          # bytes; one live demo engine (weights, KV pool) holds several times this
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def rss() -> int:
    """Resident bytes, once what is freed has gone back to the system: glibc keeps freed heap
    memory for reuse unless asked to return it (malloc_trim), which would read as growth."""
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def threads() -> int:
    """The process's threads, native ones too (OpenMP, tokenizer and grammar pools)."""
    return len(os.listdir("/proc/self/task"))


def build_and_use(device: str = "cpu") -> LLM:
    llm = LLM(demo_model_path(), device=device, show_progress=False, max_model_len=256, kv_cache_memory=8 << 20)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [6, 6]
    return llm


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(_LIBC, "malloc_trim"), reason="needs glibc (malloc_trim) to read RSS")
@pytest.mark.parametrize("how", ["close", "drop"])
def test_five_builds_leave_rss_and_threads_flat(how):
    readings = []
    for _ in range(BUILDS):
        llm = build_and_use()
        live = rss()
        if how == "close":
            llm.close()
        del llm
        readings.append((rss(), threads()))
        assert live - readings[-1][0] > 2 * RSS_TOLERANCE      # what an engine holds is given back
    base_rss, base_threads = readings[0]
    grown = [r - base_rss for r, _ in readings[1:]]
    assert max(grown) < RSS_TOLERANCE, f"RSS grew by {[g >> 20 for g in grown]} MiB after the first build"
    assert [t for _, t in readings] == [base_threads] * BUILDS


def device_bytes() -> tuple[int, int]:
    """(memory_reserved, memory_allocated) once what is free has gone back to the driver. cuBLAS's
    workspaces are the process's, not an engine's (torch keeps one per handle and stream, for any
    later matmul): cleared first, so that what remains is what an engine left."""
    gc.collect()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["close", "drop"])
def test_five_builds_give_back_every_gpu_byte(how):
    base, base_threads = device_bytes(), None
    for _ in range(BUILDS):
        llm = build_and_use("cuda")
        assert torch.cuda.memory_reserved() > base[0]
        if how == "close":
            llm.close()
        del llm
        assert device_bytes() == base
        base_threads = base_threads or threads()
        assert threads() == base_threads
