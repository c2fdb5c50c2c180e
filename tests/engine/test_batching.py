"""Acceptance: batch invariance; preemption, chunked prefill and prefix caching change nothing;
every page is free again at the end."""
import pytest

from ridge import LLM, SamplingParams
from tests.tests_support import prompt_of


def assert_pool_free(llm):
    bm = llm.engine.pages
    assert bm.num_free_pages == bm.num_pages
    assert all(c == 0 for c in bm.ref_counts)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_batch_invariance(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    target = prompt_of(13, salt=99)
    alone = tiny_llm.generate([target], greedy, use_tqdm=False)[0].outputs[0].token_ids
    others = [prompt_of(n, salt=i) for i, n in enumerate([5, 60, 1, 33, 8, 100, 2, 17, 45, 3, 70, 9, 26, 4, 51, 12])]
    batch = others[:8] + [target] + others[8:]
    outs = tiny_llm.generate(batch, greedy, use_tqdm=False)
    assert outs[8].outputs[0].token_ids == alone
    assert_pool_free(tiny_llm)


def _workload():
    prompts = [prompt_of(40 + (i * 37) % 90, salt=i) for i in range(32)]
    # a shared system-prompt-like prefix on half of them, so prefix caching has hits to make
    prefix = prompt_of(48, salt=777)
    prompts = [prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    params = [SamplingParams(temperature=0, max_tokens=30 + (i * 13) % 40, ignore_eos=True) for i in range(32)]
    return prompts, params


def _run(path, **kw):
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=512, **kw)
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_free(llm)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def ample(checkpoints):
    return _run(checkpoints("llama"))[0]


def test_preemption_and_chunking_give_identical_outputs(checkpoints, ample):
    path = checkpoints("llama")
    with LLM(path, device="cpu", show_progress=False, kv_cache_memory=1 << 20) as llm:
        page_bytes = llm.engine.runner.kv_bytes_per_page()
    # 40 pages of 16 tokens: a few requests at a time; prompts are prefilled in chunks of 64
    outs, llm = _run(path, kv_cache_memory=40 * page_bytes, max_num_batched_tokens=64)
    assert llm.engine.cfg.num_pages == 40
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs == ample


def test_prefix_caching_off_gives_identical_outputs(checkpoints, ample):
    outs, _ = _run(checkpoints("llama"), enable_prefix_caching=False)
    assert outs == ample


def test_prefix_cache_is_hit_and_pages_are_reused(tiny_llm):
    bm = tiny_llm.engine.pages
    shared = prompt_of(64, salt=5)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = tiny_llm.generate([shared + [7, 8, 9]], greedy, use_tqdm=False)[0]
    cached_before = len(bm.cached)
    eng = tiny_llm.engine
    before = eng.stats()
    eng.add_request(shared + [10, 11], greedy)
    sched = eng.scheduler.schedule()
    assert sched.scheduled[0].start == 64       # four full pages came from the cache
    assert sched.scheduled[0].num_new_tokens == 2
    after = eng.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 66
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    for rid in list(eng.requests):
        eng.abort(rid)
    assert len(bm.cached) >= cached_before
    assert first.outputs[0].token_ids
    assert_pool_free(tiny_llm)


def test_abort_frees_pages(tiny_llm):
    eng = tiny_llm.engine
    ids = [eng.add_request(prompt_of(50, salt=i), SamplingParams(temperature=0, max_tokens=50, n=2)) for i in range(4)]
    for _ in range(5):
        eng.step()
    assert tiny_llm.engine.pages.num_free_pages < tiny_llm.engine.cfg.num_pages
    for rid in ids:
        eng.abort(rid)
    assert_pool_free(tiny_llm)


def test_seat_limit_counts_the_samples_still_to_fork(checkpoints):
    """max_num_seqs bounds the sequences decoded together, n > 1 forks included: a request's first
    sequence holds its n seats from admission, so 4 requests with n=4 under 8 seats never run more
    than 8 sequences at once (before, each was admitted as one and forked to 4: 16 ran)."""
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=256, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(n=4, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
    ids = [engine.add_request(prompt_of(8 + i), params) for i in range(4)]
    most, outs = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    assert most == 8                      # the seats were used, and never more than them
    assert sorted(outs) == sorted(ids) and all(len(o.outputs) == 4 for o in outs.values())
    assert all(len(c.token_ids) == 6 for o in outs.values() for c in o.outputs)
    assert_pool_free(llm)


def test_interrupted_generate_leaves_nothing_in_the_engine(checkpoints, monkeypatch):
    """A KeyboardInterrupt inside generate() aborts the call's requests and frees their pages; the
    next call runs alone. LLM.abort stops a request added directly to the engine."""
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=256)
    engine, step = llm.engine, llm.engine.step
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", interrupted)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt_of(20 + i) for i in range(4)], params, use_tqdm=False)
    assert not engine.has_unfinished() and not engine.requests
    assert_pool_free(llm)
    monkeypatch.undo()
    rid = engine.add_request(prompt_of(9), params)
    engine.step()
    llm.abort(rid)
    llm.abort("no-such-request")
    assert not engine.has_unfinished()
    assert_pool_free(llm)
    out = llm.generate([prompt_of(7)], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
