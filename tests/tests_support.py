"""Helpers shared by test modules."""
import contextlib
import glob
import importlib.util
import os
import socket
import sys
import threading
import time

import httpx
import torch

from ridge.layers.sampler import SamplingBatch

# The repository root: the benchmarks, the README and ridge/ as a test sees them, from any folder of tests/.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Token ids 0-2 are BOS/EOS/PAD in the test checkpoints; prompts avoid them so that
# transformers' generate (which infers padding from pad ids) sees exactly what ridge sees.
PROMPT_LENGTHS = (3, 21, 7, 16, 40)


def prompt_of(length: int, salt: int = 0, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(1000 * salt + length)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def capture_cuda_graph(step):
    """Run `step` once on a side stream (compile and autotune outside the capture, as torch
    recommends), then capture it; returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def single_row_batch(params, step: int, vocab: int, device) -> SamplingBatch:
    """The SamplingBatch ridge builds for sample 0 of a request with these params at `step`."""
    def t(v, dtype=torch.float32):
        return torch.tensor([v], dtype=dtype, device=device)
    return SamplingBatch(temperature=t(params.temperature), top_k=t(params.top_k if params.top_k > 0 else vocab, torch.int64),
                         top_p=t(params.top_p), min_p=t(params.min_p), seeds=t(params.seed, torch.int64),
                         steps=t(step, torch.int64), presence_penalty=t(0.0), frequency_penalty=t(0.0),
                         repetition_penalty=t(1.0), output_counts=None, seen_mask=None, banned=None, max_logprobs=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, what: str, timeout_s: float = 120, poll_s: float = 0.1, alive=None) -> None:
    """Poll url/health until it answers 200; `alive()` (if given) asserts the server still runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None:
            alive()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not become healthy"
        time.sleep(poll_s)


@contextlib.contextmanager
def serving(app, what: str = "server"):
    """Run `app` on uvicorn on a free loopback port in a thread; yields its URL. One intra-op torch
    thread meanwhile: the test models' ops are microseconds, and spinning OpenMP workers competing
    with the event loop on a 2-core CI machine make every step ~10x slower."""
    import uvicorn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, what)
        yield url
    finally:
        srv.should_exit = True
        thread.join(60)
        torch.set_num_threads(threads)
    assert not thread.is_alive(), f"{what} did not stop"


def load_benchmark(name: str):
    """benchmarks/<folder>/NAME.py imported as a module under its own name (the benchmarks run as scripts)."""
    (path,) = glob.glob(os.path.join(REPO, "benchmarks", "*", f"{name}.py"))
    return load_script(path, f"bench_{name}")


def load_script(path: str, name: str | None = None):
    """A script (a file path; scripts/ and benchmarks/ are run, not imported) as a module."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def leaked_step_rings() -> list[str]:
    """Step-ring segments in /dev/shm whose creating process is gone (ridge/runner/step_ring.py names
    them ridge_ring_<pid>_<random>): what a finished engine or job must not leave. A ring of another
    test running at the same time belongs to a live process and is not counted."""
    from ridge.runner.step_ring import SEGMENT_PREFIX
    leaked = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(SEGMENT_PREFIX):
            pid = int(name[len(SEGMENT_PREFIX):].split("_")[0])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                leaked.append(name)
            except PermissionError:             # alive, another user's
                pass
    return leaked
