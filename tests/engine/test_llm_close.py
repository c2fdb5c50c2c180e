"""An LLM gives its device memory back: when it is closed, at the end of its `with` block, and
when its last reference goes, without waiting for the garbage collector (on a GPU an engine kept
alive by reference cycles holds its weights, KV pool and CUDA graphs until a collection happens to
run, and the next engine in the process runs out of memory). Checked through weak references to
what holds the memory: the KV pool, each layer's pages, the model and its parameters, the decode
buffers and graphs."""
import contextlib
import gc
import weakref

import pytest

from ridge import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@contextlib.contextmanager
def no_collector():
    """The cyclic garbage collector off: what is freed inside is freed by reference counts (or by
    the engine's own teardown), not by a collection that happened to run."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def holders(llm) -> dict[str, weakref.ref]:
    """Weak references to the objects that hold the engine's device memory."""
    runner = llm.engine.runner
    held = {"kv pool": runner.kv_cache, "layer 0 pages": runner.layer_caches[0].k, "model": runner.model,
            "a weight": next(runner.model.parameters())}
    if runner.decode_graphs is not None:
        held["decode graphs"] = runner.decode_graphs
    return {name: weakref.ref(obj) for name, obj in held.items()}


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


@pytest.fixture
def llama(checkpoints):
    """The checkpoint's path, made outside the tests: making it can leave a cached exception whose
    traceback holds the calling frames, and so any LLM in them."""
    return checkpoints("llama")


def build(path, **kw):
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=64, max_num_seqs=2, **kw)
    llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)
    return llm


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dropped_llm_frees_its_memory_without_a_collection(llama, backend):
    with no_collector():
        llm = build(llama, attention_backend=backend)
        refs = holders(llm)
        assert (backend == "triton") == ("decode graphs" in refs)      # the static decode path exists to free
        del llm
        assert alive(refs) == []


def test_close_frees_the_memory_while_the_llm_is_still_referenced(llama):
    llm = build(llama)
    refs = holders(llm)
    with no_collector():
        llm.close()
        assert alive(refs) == []
        llm.close()                                     # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.abort("0")


def test_a_with_block_closes_the_llm(llama):
    with no_collector():
        with build(llama) as llm:
            refs = holders(llm)
            assert len(llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3
            assert alive(refs) == list(refs)
        assert alive(refs) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)


def test_a_with_block_closes_the_llm_when_its_body_raises(llama):
    with pytest.raises(KeyError):
        with build(llama) as llm:
            refs = holders(llm)
            raise KeyError("the body failed")
    assert alive(refs) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)


def test_a_closed_tensor_parallel_llm_frees_rank_zero_and_stops_its_workers(llama):
    """The worker pool calls back into rank 0's runner before it leaves the group (its graphs go
    first): after close no callback keeps the runner, and so the model and pool, alive."""
    import os
    llm = build(llama, attention_backend="triton", tensor_parallel_size=2)
    pool, refs = llm.engine.runner.workers, holders(llm)
    with no_collector():
        llm.close()
        assert alive(refs) == []
    for pid in pool.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 9, 13]], GREEDY, use_tqdm=False)
