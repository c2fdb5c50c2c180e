"""Acceptance: bad inputs raise ValueError naming the parameter; the engine serves on."""
import pytest

from ridge import SamplingParams
from tests.tests_support import prompt_of

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("make, param", [
    (lambda: dict(prompt=""), "prompt"),
    (lambda: dict(prompt=[]), "prompt"),
    (lambda: dict(prompt=[5, 600, 7]), "prompt"),            # vocab is 512
    (lambda: dict(prompt=[5, -1]), "prompt"),
    (lambda: dict(prompt=[5, "x"]), "prompt"),
    (lambda: dict(prompt=prompt_of(600)), "prompt"),         # max_model_len is 512
    (lambda: dict(params=SamplingParams(max_tokens=510)), "max_tokens"),
    (lambda: dict(params=dict(max_tokens=0)), "max_tokens"),
    (lambda: dict(params=dict(temperature=-0.1)), "temperature"),
    (lambda: dict(params=dict(top_p=0.0)), "top_p"),
    (lambda: dict(params=dict(top_p=1.5)), "top_p"),
    (lambda: dict(params=dict(top_k=-2)), "top_k"),
    (lambda: dict(params=dict(n=0)), "n"),
    (lambda: dict(params=SamplingParams(n=65)), "n"),        # above the engine's max_n cap
    (lambda: dict(params=dict(logprobs=21)), "logprobs"),
    (lambda: dict(params=dict(stop=[""])), "stop"),
    (lambda: dict(params=dict(stop="")), "stop"),
    (lambda: dict(params=dict(min_p=2.0)), "min_p"),
    (lambda: dict(params=dict(presence_penalty=3.0)), "presence_penalty"),
    (lambda: dict(params=dict(repetition_penalty=0.0)), "repetition_penalty"),
    (lambda: dict(params=dict(repetition_penalty=1e-300)), "repetition_penalty"),    # 0 in float32
])
def test_bad_input_names_parameter_and_engine_serves_on(tiny_llm, make, param):
    case = make()
    prompt = case.get("prompt", prompt_of(10))
    params = case.get("params", GOOD)
    before = tiny_llm.generate([prompt_of(10, salt=1)], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=rf"^{param}:"):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        tiny_llm.generate([prompt_of(6, salt=2), prompt], [GOOD, params], use_tqdm=False)
    assert not tiny_llm.engine.requests              # the call's accepted request was withdrawn
    bm = tiny_llm.engine.pages
    assert bm.num_free_pages == bm.num_pages
    after = tiny_llm.generate([prompt_of(10, salt=1)], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_request_that_can_never_fit_the_cache_is_rejected(checkpoints):
    from ridge import LLM
    path = checkpoints("llama")
    probe = LLM(path, device="cpu", show_progress=False, kv_cache_memory=1 << 20)
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=512,
              kv_cache_memory=4 * probe.engine.runner.kv_bytes_per_page())
    with pytest.raises(ValueError, match="^max_tokens:.*KV pages"):
        llm.generate([prompt_of(40)], SamplingParams(max_tokens=40), use_tqdm=False)
    out = llm.generate([prompt_of(40)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(page_size=0), "page_size"),
    (dict(kv_cache_memory=1.5), "kv_cache_memory"),
    (dict(kv_cache_memory=100), "kv_cache_memory"),
    (dict(max_model_len=10**6), "max_model_len"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
])
def test_bad_engine_options(checkpoints, kwargs, param):
    from ridge import LLM
    with pytest.raises(ValueError, match=rf"^{param}:"):
        LLM(checkpoints("llama"), show_progress=False, **{"device": "cpu", **kwargs})


def test_missing_model_directory():
    from ridge import LLM
    with pytest.raises(ValueError, match="^model:"):
        LLM("/nonexistent/checkpoint", device="cpu")


def test_n_is_capped_by_max_num_seqs(checkpoints):
    from ridge import LLM
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, max_num_seqs=4)
    with pytest.raises(ValueError, match="^n:"):
        llm.generate([prompt_of(5)], SamplingParams(n=5), use_tqdm=False)
    out = llm.generate([prompt_of(5)], SamplingParams(n=4, max_tokens=3, ignore_eos=True, seed=1), use_tqdm=False)
    assert len(out[0].outputs) == 4


def test_backend_choice():
    import torch
    from ridge.layers.attention import select_backend
    assert select_backend(torch.device("cpu")).name == "torch"
    assert select_backend(torch.device("cuda"), "auto", head_dim=96).name == "torch"
    with pytest.raises(ValueError, match="^attention_backend:"):
        select_backend(torch.device("cuda"), "triton", head_dim=96)
    with pytest.raises(ValueError, match="^attention_backend:"):
        select_backend(torch.device("cpu"), "flash")


def test_seed_and_top_k_beyond_int64_are_rejected_and_engine_stays_clean(tiny_llm):
    from ridge import SamplingParams
    for bad in (dict(seed=2**64), dict(top_k=2**63)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=2, **bad), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished()
    assert tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


# -- SamplingParams: types and finiteness --------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    (dict(stop=5), "stop"), (dict(stop=[5]), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=-0.5), "top_p"), (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(n=True), "n"), (dict(max_tokens=True), "max_tokens"), (dict(min_tokens=False), "min_tokens"),
    (dict(top_k=True), "top_k"), (dict(seed=True), "seed"), (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(temperature=True), "temperature"), (dict(max_tokens=2.0), "max_tokens"), (dict(top_k=10**400), "top_k"),
    # finite but outside the ranges the float32 sampler survives (sampling_params.py says why)
    (dict(repetition_penalty=1e-300), "repetition_penalty"), (dict(repetition_penalty=1e-3), "repetition_penalty"),
    (dict(repetition_penalty=101), "repetition_penalty"), (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(temperature=1e-300), "temperature"), (dict(temperature=1e-30), "temperature"),
    (dict(temperature=1e30), "temperature"), (dict(frequency_penalty=1e300), "frequency_penalty"),
])
def test_sampling_params_reject_with_value_error(kwargs, param):
    with pytest.raises(ValueError, match=rf"^{param}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=0.01), dict(repetition_penalty=100),
                                    dict(temperature=1e-20), dict(temperature=1e-10), dict(temperature=1e20),
                                    dict(presence_penalty=-2, frequency_penalty=2)])
def test_sampling_params_range_ends_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_range_ends_sample_without_overflow(tiny_llm):
    """At the smallest temperature and repetition penalty (every seen token's logit x 100, then
    x 1e20) no logit overflows: the seeded sample is the greedy token of the same penalised logits."""
    kw = dict(max_tokens=12, ignore_eos=True, repetition_penalty=0.01)
    prompt = prompt_of(10, salt=4)
    tiny = tiny_llm.generate([prompt], SamplingParams(temperature=1e-20, seed=3, **kw), use_tqdm=False)
    greedy = tiny_llm.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    hot = tiny_llm.generate([prompt], SamplingParams(temperature=1e20, repetition_penalty=100, seed=3, max_tokens=12,
                                                     ignore_eos=True, min_tokens=12), use_tqdm=False)
    assert all(0 <= t < 512 for t in hot[0].outputs[0].token_ids) and len(hot[0].outputs[0].token_ids) == 12


# -- LLM.generate / LLM.chat: malformed calls leave the engine's requests as they were -----------------
def _in_flight(llm):
    """A request queued straight on the engine, which a rejected call must leave alone."""
    rid = llm.engine.add_request(prompt_of(8, salt=3), GOOD)
    return rid


def _finish(llm, rid):
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the in-flight request was lost")


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate([prompt_of(4)], {"max_tokens": 2}, use_tqdm=False), "^sampling_params: .*dict"),
    (lambda llm: llm.generate([prompt_of(4)], [{"max_tokens": 2}], use_tqdm=False), "^sampling_params:"),
    (lambda llm: llm.generate([prompt_of(4)], "greedy", use_tqdm=False), "^sampling_params:"),
    (lambda llm: llm.generate([prompt_of(4), prompt_of(5)], [GOOD], use_tqdm=False), "^sampling_params: 1 given"),
    (lambda llm: llm.generate(None, GOOD, use_tqdm=False), "^prompts:"),
    (lambda llm: llm.generate(5, GOOD, use_tqdm=False), "^prompts:"),
    (lambda llm: llm.generate([], GOOD, use_tqdm=False), "^prompts:"),
    (lambda llm: llm.chat({"role": "user", "content": "hi"}, GOOD, use_tqdm=False), "^messages:"),
    (lambda llm: llm.chat([], GOOD, use_tqdm=False), "^messages:"),
    (lambda llm: llm.chat([{"content": "hi"}], GOOD, use_tqdm=False), r"^messages\[0\]: missing 'role'"),
    (lambda llm: llm.chat([{"role": "user"}], GOOD, use_tqdm=False), r"^messages\[0\]: missing 'content'"),
    (lambda llm: llm.chat([{"role": "wizard", "content": "hi"}], GOOD, use_tqdm=False), r"^messages\[0\]\.role:"),
    (lambda llm: llm.chat([{"role": "user", "content": 5}], GOOD, use_tqdm=False), r"^messages\[0\]\.content:"),
    (lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GOOD, use_tqdm=False),
     r"^messages\[0\]\.content\[0\]:"),
    (lambda llm: llm.chat(["hello"], GOOD, use_tqdm=False), r"^messages\[0\]:"),
    (lambda llm: llm.chat([[{"role": "user", "content": "a"}], [{"role": "user"}]], GOOD, use_tqdm=False),
     r"^messages\[0\]: missing 'content'"),
])
def test_malformed_calls_raise_value_error_and_keep_requests_in_flight(tiny_llm, call, message):
    rid = _in_flight(tiny_llm)
    with pytest.raises(ValueError, match=message):
        call(tiny_llm)
    assert rid in tiny_llm.engine.requests
    assert len(_finish(tiny_llm, rid).outputs[0].token_ids) == GOOD.max_tokens
    bm = tiny_llm.engine.pages
    assert bm.num_free_pages == bm.num_pages


def test_chat_accepts_openai_text_parts(tiny_llm):
    plain = tiny_llm.chat([{"role": "user", "content": "hello there"}], GOOD, use_tqdm=False)[0]
    parts = tiny_llm.chat([{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                        {"type": "text", "text": "there"}]}], GOOD, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    assert parts.outputs[0].token_ids == plain.outputs[0].token_ids


def test_engine_settings_rejected_before_loading(checkpoints):
    from ridge import LLM
    for kwargs, param in ((dict(max_model_len=0), "max_model_len"), (dict(seed="x"), "seed"),
                          (dict(enforce_eager="yes"), "enforce_eager"), (dict(max_n=True), "max_n"),
                          (dict(kv_cache_memory=1 << 20, gpu_memory_utilization=0.5), "gpu_memory_utilization"),
                          (dict(block_size=16), "block_size")):
        with pytest.raises(ValueError, match=rf"^{param}:"):
            LLM(checkpoints("llama"), device="cpu", show_progress=False, **kwargs)
