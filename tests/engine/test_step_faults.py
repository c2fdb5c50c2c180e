"""A fault inside an engine step costs the requests of that step, not the engine (ridge/engine/faults.py):
a kernel that raises, out of memory in a prefill, non-finite logits and a tokenizer that fails to
detokenize each end the step's requests with StepFault, every page goes back to the pool, and the
next request gets exactly a clean engine's greedy tokens; on the overlapped decode path too, where
a step launched ahead of the faulted one is dropped. A device error (CUDA's illegal memory access)
is fatal: the engine runs no further step. Each fault is injected by patching the runner or the
tokenizer in the test."""
from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.faults import NonFiniteLogits, StepFault, readback_ids, unrecoverable
from tests.fault_injection import DEVICE_LOST, FAULTS, fail_runner, inject

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["def add(a, b):", "import os\n"]


def demo_llm(**kw) -> LLM:
    return LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=256, kv_cache_memory=8 << 20, **kw)


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def demo():
    with demo_llm() as llm:
        yield llm


@pytest.fixture(scope="module")
def clean(demo) -> list[list[int]]:
    return token_ids(demo.generate(PROMPTS, GREEDY, use_tqdm=False))


def assert_all_free(llm: LLM) -> None:
    st, engine = llm.engine.stats(), llm.engine
    assert st.num_free_pages == st.num_pages and st.num_running == st.num_waiting == 0
    assert not engine.has_unfinished() and not engine.requests and engine.overlap.inflight is None


@pytest.mark.parametrize("kind", FAULTS)
def test_a_fault_ends_the_steps_requests_and_the_engine_serves_on(demo, clean, monkeypatch, kind):
    inject(kind, monkeypatch, demo.engine)
    # a request with n = 2 beside a plain one: every sample of a request in the step ends
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=6, ignore_eos=True)]
    with pytest.raises(StepFault) as e:
        demo.generate(PROMPTS, params, use_tqdm=False)
    assert not e.value.fatal and len(e.value.request_ids) == 2
    if kind == "non-finite logits":
        assert isinstance(e.value.__cause__, NonFiniteLogits) and "non-finite logits" in e.value.reason
    assert_all_free(demo)
    monkeypatch.undo()
    assert token_ids(demo.generate(PROMPTS, GREEDY, use_tqdm=False)) == clean
    assert_all_free(demo)


def test_a_fault_spares_the_requests_waiting_outside_the_step(monkeypatch):
    llm = demo_llm(max_num_seqs=1)
    clean = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="running")
    engine.add_request(PROMPTS[1], GREEDY, request_id="waiting")        # no seat for it yet
    fail_runner(monkeypatch, llm.engine, 2, RuntimeError("triton: kernel launch failed"))
    with pytest.raises(StepFault) as e:
        for _ in range(3):
            engine.step()
    assert e.value.request_ids == ["running"] and list(engine.requests) == ["waiting"]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert done == {"waiting": clean[1]}
    assert_all_free(llm)
    llm.close()


@pytest.fixture(scope="module")
def overlapped(checkpoints):
    """The overlapped decode path (the static path: Triton's, interpreted here, one layer)."""
    with LLM(checkpoints("llama-1layer"), device="cpu", show_progress=False, max_model_len=32, max_num_seqs=4,
             attention_backend="triton", async_scheduling=True) as llm:
        yield llm


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["non-finite logits", "kernel error"])
def test_a_fault_on_the_overlapped_path_drops_the_step_launched_ahead(overlapped, monkeypatch, kind):
    """A step launched ahead whose predecessor's ids turn out non-finite, or whose own forward
    raises while its predecessor's ids are still on the device: both steps' requests end."""
    prompts, params = [[5, 9, 13], [7, 7, 7, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = token_ids(overlapped.generate(prompts, params, use_tqdm=False))
    before = overlapped.engine.stats().num_overlapped_steps
    calls = fail_runner(monkeypatch, overlapped.engine, 4, RuntimeError("triton: kernel launch failed")) \
        if kind == "kernel error" else fail_runner(monkeypatch, overlapped.engine, 3, poison=True)
    with pytest.raises(StepFault) as e:
        overlapped.generate(prompts, params, use_tqdm=False)
    assert len(e.value.request_ids) == 2 and not e.value.fatal and len(calls) >= 3
    assert overlapped.engine.stats().num_overlapped_steps > before     # the fault came on the overlapped path
    assert_all_free(overlapped)
    monkeypatch.undo()
    assert token_ids(overlapped.generate(prompts, params, use_tqdm=False)) == clean
    assert_all_free(overlapped)


def test_a_lost_device_is_fatal(monkeypatch):
    llm = demo_llm()
    fail_runner(monkeypatch, llm.engine, 1, torch.AcceleratorError(DEVICE_LOST))
    with pytest.raises(StepFault, match="device is lost") as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert e.value.fatal and len(e.value.request_ids) == 2
    monkeypatch.undo()
    with pytest.raises(StepFault, match="lost earlier") as e:         # no further step runs
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert e.value.fatal
    llm.close()


def test_which_errors_lose_the_device():
    assert unrecoverable(torch.AcceleratorError(DEVICE_LOST))
    assert unrecoverable(RuntimeError("CUDA error: device-side assert triggered"))
    assert not unrecoverable(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not unrecoverable(RuntimeError("CUDA error: out of memory"))
    assert not unrecoverable(RuntimeError("triton: kernel launch failed"))
    assert not unrecoverable(Exception("tokenizer: could not decode token"))


def test_readback_flags_exactly_the_non_finite_rows():
    logits = torch.tensor([[0.0, 2.0, -float("inf")],          # a masked logit is not a fault
                           [float("nan"), 1.0, 0.0],
                           [float("inf"), 1.0, 0.0],
                           [-float("inf")] * 3,
                           [1.0, 0.5, 0.0]])
    tokens = logits.argmax(-1)
    assert readback_ids(logits, tokens, greedy=True).tolist() == [1, -1, -1, -1, 0]
    assert tokens.tolist()[1:4] == [0, 0, 0]                   # the device's ids stay valid inputs
    # sampled rows: the id drawn need not be the argmax; the check still sees the NaN and the inf
    drawn = torch.tensor([0, 1, 1, 2, 1])
    assert readback_ids(logits, drawn, greedy=False).tolist() == [0, -1, -1, -1, 1]


def test_a_fault_in_a_verify_step_frees_the_draft_models_state_too(monkeypatch):
    """Speculation with a draft model (pages and sequences of its own) and a grammar-constrained
    request: a fault in a step verifying drafts ends both requests; their draft state goes at the
    next step's plan, as an aborted sequence's does, and the next call's greedy tokens (drafted and
    constrained again) equal a clean engine's."""
    import os
    draft = os.path.join(os.path.dirname(demo_model_path()), "demo-code-3m")
    llm = demo_llm(speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    spec = llm.engine.speculator
    spec.cutoff = llm.engine.cfg.max_num_seqs        # draft at every step, whatever this machine's timings
    spec.clock.pays, spec.clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no", "maybe"]})]
    clean = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    run, faulted = llm.engine.runner.run, []

    def fails_verifying(plan, previous=None):
        if any(s.draft_token_ids for s in llm.engine.scheduler.running):
            faulted.extend(s.seq_id for s in llm.engine.scheduler.running)
            raise RuntimeError("triton: kernel launch failed")
        return run(plan, previous)

    monkeypatch.setattr(llm.engine.runner, "run", fails_verifying)
    with pytest.raises(StepFault) as e:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(e.value.request_ids) == 2 and faulted
    assert_all_free(llm)
    monkeypatch.undo()
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == clean
    assert llm.engine.stats().spec_num_drafts > 0
    assert not set(faulted) & set(spec.proposer.states)
    assert_all_free(llm)
    llm.close()
