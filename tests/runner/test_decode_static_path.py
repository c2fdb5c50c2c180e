"""The padded static-buffer decode path (what CUDA graphs replay), run eagerly on the CPU through
the Triton interpreter: bucket padding, empty rows and slot -1 must change no output. The model has
one decoder layer: every token costs interpreted kernel programs in each layer, and what these tests
check (buckets, padding, overlap, aborts, late arrivals) is the same in every layer."""
import dataclasses

import pytest

from ridge import LLM, SamplingParams
from ridge.runner.cuda_graphs import batch_buckets


def test_batch_buckets():
    assert batch_buckets(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_static_decode_path_matches_reference(checkpoints):
    path = checkpoints("llama-1layer")
    prompts = [[5, 9, 13], [7] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 33, [8, 8]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=128, max_num_seqs=6,
                  attention_backend=backend)
        assert (llm.engine.runner.decode_graphs is not None) == (backend == "triton")
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["triton"] == runs["torch"]


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_overlapped_decode_matches_synchronous(checkpoints):
    """Launching each decode step before the previous step's ids are read back (async
    scheduling) changes no output: greedy and seeded sampling, min_tokens, n > 1, sequences
    ended by length, by max_model_len, and by a stop token while the next step is in flight."""
    path = checkpoints("llama-1layer")
    # every token is a Triton-interpreter launch per layer, so the prompts are short: two pages at most
    llms = {mode: LLM(path, device="cpu", show_progress=False, max_model_len=32, max_num_seqs=6,
                      attention_backend="triton", async_scheduling=mode) for mode in (False, True)}
    prompts = [[5, 9, 13], [7] * 12, [3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 17, [8, 8]]
    base = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True, min_tokens=3),
            SamplingParams(temperature=0.7, seed=3, max_tokens=11, ignore_eos=True, n=2),
            SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),     # max_model_len ends it
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    sync = _outputs(llms[False], prompts, base)
    # stop each request on a token it produced midway in the synchronous run
    stopping = [dataclasses.replace(p, stop_token_ids=[out[0][0][len(out[0][0]) // 2]])
                for p, out in zip(base, sync)]
    for params in (base, stopping):
        expected = sync if params is base else _outputs(llms[False], prompts, params)
        before = llms[True].engine.stats().num_overlapped_steps
        assert _outputs(llms[True], prompts, params) == expected
        assert llms[True].engine.stats().num_overlapped_steps > before
    assert any(reason == "stop" for out in expected for _, reason in out)       # the stopping run's
    for llm in llms.values():                   # every page back in the pool
        st = llm.engine.stats()
        assert st.num_free_pages == st.num_pages and not llm.engine.has_unfinished()


@pytest.mark.slow
def test_overlapped_decode_abort_and_late_arrival(checkpoints):
    """An abort while a step is in flight and a request arriving mid-decode leave the other
    requests' outputs as in synchronous mode and return every page. max_model_len 32 holds every
    request (16 tokens at most) with one attention split (the overlapped steps' split merges are
    test_overlap_engages_with_logprobs_and_full_seats's)."""
    path = checkpoints("llama-1layer")
    results = {}
    for mode in (False, True):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=32, max_num_seqs=4,
                  attention_backend="triton", async_scheduling=mode)
        eng = llm.engine
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        eng.add_request([5, 6, 7], p, request_id="a")
        eng.add_request([9, 9, 9, 9], p, request_id="b")
        done, steps = {}, 0
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 4:
                eng.abort("b")
            if steps == 6:
                eng.add_request([11, 12], p, request_id="c")
        results[mode] = done
        st = eng.stats()
        assert st.num_free_pages == st.num_pages
        assert (st.num_overlapped_steps > 0) == mode      # streaming callers (step() each turn) overlap too
    assert results[True] == results[False] and set(results[True]) == {"a", "c"}


@pytest.mark.slow
def test_overlap_engages_with_logprobs_and_full_seats(checkpoints):
    """Requests asking for logprobs overlap too (the logprob tensors ride with the ids), with the
    same tokens and logprobs as synchronous mode; a request waiting for a seat does not stop the
    running ones from overlapping. stats() reports the fraction of decode steps overlapped."""
    path = checkpoints("llama-1layer")
    runs = {}
    for mode in (False, True):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=48, max_num_seqs=2,
                  attention_backend="triton", async_scheduling=mode)
        prompts = [[5, 9, 13], [7] * 9, [3, 4]]
        params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=5, max_tokens=10, ignore_eos=True,
                                 logprobs=1),
                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]    # waits for a seat
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [(c.token_ids, [{t: (round(lp.logprob, 5), lp.rank) for t, lp in e.items()} for e in c.logprobs or []])
                      for o in outs for c in o.outputs]
        st = llm.engine.stats()
        assert st.num_free_pages == st.num_pages
        if mode:
            assert st.num_overlapped_steps > 0 and 0 < st.overlap_fraction <= 1
        else:
            assert st.num_overlapped_steps == 0 and st.overlap_fraction == 0
    assert runs[True] == runs[False]
