"""Structured outputs (ridge/engine/structured.py) on the demo model, CPU: every output under a JSON
schema, a JSON object, a regex, a choice or an EBNF grammar parses, alone and in batches mixed with
free requests, with n > 1, preemption, prefix-cache hits, speculative decoding and the overlapped
decode path; bad requests are refused by field and leave the engine as it was."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path

DEMO = demo_model_path()
PROMPTS = ["def parse(path):", "import os\n", "class Point:", "# settings\nconfig = ", "for i in range(10):"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[a-z]{2,5}_[0-9]{1,3}"
CHOICE = ["yes", "no", "it depends"]
GRAMMAR = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]*'


def constrained(kind, **kw):
    value = {"json": SCHEMA, "json_object": True, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR}[kind]
    return SamplingParams(structured_outputs={kind: value}, **{"max_tokens": 64, "temperature": 0.9, **kw})


def check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE
    else:
        assert re.fullmatch(r"\([1-9][0-9]*(,[1-9][0-9]*)*\)", text), text


@pytest.fixture(scope="module")
def demo():
    return LLM(DEMO, device="cpu", show_progress=False, max_model_len=512)


@pytest.mark.parametrize("kind", ["json", "json_object", "regex", "choice", "grammar"])
def test_every_output_parses_and_free_requests_in_the_batch_are_untouched(demo, kind):
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = [o.outputs[0].token_ids for o in demo.generate(PROMPTS[:2], free, use_tqdm=False)]
    # any JSON object: at 0.9 a draw may run on past max_tokens (keys without end); at 1.0 these three close
    params = [constrained(kind, seed=i, **({"max_tokens": 160, "temperature": 1.0} if kind == "json_object" else {}))
              for i in range(3)]
    outs = demo.generate(PROMPTS[:2] + PROMPTS[2:5], [free, free] + params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for o in outs[2:]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]     # the grammar's end, before max_tokens
        check(kind, o.outputs[0].text)


def test_n_samples_each_follow_the_grammar_on_their_own(demo):
    out = demo.generate(PROMPTS[0], constrained("regex", n=4, temperature=1.0, seed=3), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    for t in texts:
        check("regex", t)
    assert len(set(texts)) > 1                             # four draws, not one copied


def test_greedy_under_a_grammar_is_the_same_across_preemption_prefix_hits_and_speculation(demo):
    """Greedy constrained outputs do not depend on how the engine computed them: preempted and
    recomputed, from prefix-cache hits, or with speculation beside free requests (the constrained
    sequences take drafts too, checked against their grammar: tests/spec/test_spec_grammar.py)."""
    prompts = ["x = 1\n" * 12 + p for p in PROMPTS]
    params = constrained("json", temperature=0)
    want = [o.outputs[0].text for o in demo.generate(prompts, params, use_tqdm=False)]
    for t in want:
        check("json", t)
    tight = LLM(DEMO, device="cpu", show_progress=False, max_model_len=512, enable_prefix_caching=True,
                page_size=8, max_num_batched_tokens=32, kv_cache_memory=16 * 2 * 6 * 8 * 2 * 64 * 4)
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.engine.stats().num_preemptions > 0 and tight.engine.stats().prompt_tokens < sum(
        len(tight.engine.tokenizer.encode(p)) for p in prompts)
    spec = LLM(DEMO, device="cpu", show_progress=False, max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    mixed = spec.generate(prompts + prompts[:2], [params] * len(prompts) + [SamplingParams(max_tokens=24,
                                                                                      temperature=0)] * 2,
                          use_tqdm=False)
    assert [o.outputs[0].text for o in mixed[:len(prompts)]] == want
    assert sum(o.metrics.num_drafts for o in mixed[:len(prompts)]) > 0


@pytest.mark.slow
def test_overlapped_decode_under_grammars_matches_synchronous():
    """The overlapped decode path (the static path, launched before the previous ids are read)
    keeps constrained rows: the launched step's forward runs ahead and its rows are sampled under
    masks made after the previous ids are committed. Greedy and seeded grammars beside a free
    request give what synchronous steps give, grammars that end while the next step is in flight
    included, and every page comes back. (The small demo model: each step runs the Triton
    interpreter per layer.)"""
    params = [constrained("regex", max_tokens=12, temperature=0), SamplingParams(max_tokens=6, temperature=0),
              constrained("choice", max_tokens=12, seed=3)]
    runs = {}
    for overlap in (False, True):
        llm = LLM("demo-code-3m", device="cpu", show_progress=False, max_model_len=32,
                  max_num_seqs=4, attention_backend="triton", async_scheduling=overlap)
        runs[overlap] = [o.outputs[0] for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        st = llm.engine.stats()
        assert (st.num_overlapped_steps > 0) == overlap
        assert st.num_free_pages == st.num_pages and not llm.engine.has_unfinished()
    assert [(c.token_ids, c.finish_reason) for c in runs[True]] == [(c.token_ids, c.finish_reason) for c in runs[False]]
    check("regex", runs[True][0].text)
    check("choice", runs[True][2].text)
    assert runs[True][0].finish_reason == runs[True][2].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_min_tokens_past_the_grammars_end_gives_way_to_the_grammar(demo, temperature):
    """min_tokens bans the stop tokens, but a grammar at its end allows nothing else: there the
    grammar wins and the request ends complete ("stop", fewer tokens than min_tokens; found by the
    server's schema fuzzing: every logit was -inf and the draw fell outside the grammar). Where
    the grammar allows more than a stop, min_tokens still holds: the regex's digits run on to three,
    its longest (after one or two a stop was allowed, and banned)."""
    for kind in ("choice", "json"):            # grammars that end: a bounded schema, a choice
        params = constrained(kind, min_tokens=160, temperature=temperature, seed=1, max_tokens=160)
        out = demo.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) < 160, out
        check(kind, out.text)
    out = demo.generate(PROMPTS[0], constrained("regex", min_tokens=20, temperature=temperature, seed=1),
                        use_tqdm=False)[0].outputs[0]
    check("regex", out.text)
    assert out.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,5}_[0-9]{3}", out.text), out


def test_a_length_limit_inside_the_structure_says_length(demo):
    out = demo.generate(PROMPTS[0], constrained("json", max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize("value, message", [
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"jsn": {}}, "unknown field(s) jsn"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json: XGrammar cannot compile"),
    ({"regex": "(unclosed"}, "structured_outputs.regex: XGrammar cannot compile"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: XGrammar cannot compile"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ("json", "structured_outputs: an object"),
])
def test_bad_requests_are_refused_by_field_and_lose_nothing(demo, value, message):
    engine = demo.engine
    ok = engine.add_request("def f():", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("def g():", SamplingParams(max_tokens=3, structured_outputs=value))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == [ok] and not engine.scheduler.has_work()
    assert not engine.requests                             # the refused request left nothing behind


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_output_parses_beside_free_requests_on_the_decode_graphs():
    """On the GPU (bf16, Triton kernels, decode graphs): XGrammar's mask applied on the device to the
    sampled rows, free requests decoding beside them (their tokens against a batch of other sizes are
    the CPU test's: bf16 kernels at other batch sizes may break a near-tie), on the overlapped path,
    whose greedy constrained outputs equal synchronous steps' at the same batch."""
    with LLM(DEMO, show_progress=False, dtype="bfloat16", kv_cache_memory=1 << 28, max_model_len=512) as llm:
        free = SamplingParams(max_tokens=16, temperature=0)
        kinds = ["json", "regex", "choice", "grammar"]
        outs = llm.generate(PROMPTS[:2] + PROMPTS[:4], [free, free] + [constrained(k, seed=i) for i, k in enumerate(kinds)],
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs[:2])
        for kind, o in zip(kinds, outs[2:]):
            assert o.outputs[0].finish_reason == "stop"
            check(kind, o.outputs[0].text)
        assert llm.engine.stats().num_overlapped_steps > 0     # constrained rows on the overlapped path
        greedy = constrained("json", temperature=0)
        overlapped = llm.generate(PROMPTS, greedy, use_tqdm=False)
    with LLM(DEMO, show_progress=False, dtype="bfloat16", kv_cache_memory=1 << 28, max_model_len=512,
             async_scheduling=False) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in overlapped]


@pytest.mark.parametrize("constrained_rows", [3, 34])      # one matcher after another; XGrammar's thread pool
def test_the_mask_allows_exactly_each_matchers_tokens_and_leaves_other_rows(demo, constrained_rows):
    """Grammars.mask against each matcher's own bitmask, with matchers at different places in their
    grammars, beside a free row and a finished one (neither touched)."""
    from types import SimpleNamespace

    import torch
    import xgrammar as xgr

    from ridge.engine.structured import THREADED_FILL_ROWS, StructuredOutputsParams
    assert 3 < THREADED_FILL_ROWS <= 34                    # the two cases take the two paths
    demo.engine.intake.compile_grammar(constrained("regex"))   # makes the engine's Grammars
    grammars = demo.engine.intake.grammars
    vocab = grammars.vocab_size
    seqs, gen = [], torch.Generator().manual_seed(0)
    for r in range(constrained_rows):
        matcher = grammars.matcher(StructuredOutputsParams(json=SCHEMA) if r % 2 else StructuredOutputsParams(regex=REGEX))
        for _ in range(r % 5):                    # walk r % 5 allowed tokens in
            row = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(row)
            allowed = [t for t in range(vocab) if (row[0, t // 32] >> (t % 32)) & 1]
            assert matcher.accept_token(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
        seqs.append(SimpleNamespace(grammar=matcher, grammar_after=None, is_finished=False))
    seqs.insert(1, SimpleNamespace(grammar=None, grammar_after=None, is_finished=False))
    seqs.append(SimpleNamespace(grammar=grammars.matcher(StructuredOutputsParams(regex=REGEX)), grammar_after=None,
                               is_finished=True))
    logits = torch.randn(len(seqs), vocab, generator=gen)
    masked = logits.clone()
    grammars.mask(masked, seqs)
    for i, s in enumerate(seqs):
        if s.grammar is None or s.is_finished:
            assert torch.equal(masked[i], logits[i])
            continue
        row = xgr.allocate_token_bitmask(1, vocab)
        s.grammar.fill_next_token_bitmask(row)
        bits = torch.tensor([(int(row[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        assert torch.equal(masked[i][bits], logits[i][bits]) and bool((masked[i][~bits] == float("-inf")).all())
        assert 0 < int(bits.sum()) < vocab


def test_a_grammar_that_starts_after_a_text_leaves_the_output_free_until_then(demo):
    """structured_outputs.start_after (what the server sets under a reasoning parser whose output opens
    in the reasoning: `</think>`): the tokens up to the one that completes the text are free (plain
    decoding's, greedy), the rest is held to the grammar; with speculation the same tokens."""
    prompt, k = PROMPTS[0], 6
    free = demo.generate(prompt, SamplingParams(max_tokens=k, temperature=0), use_tqdm=False)[0].outputs[0]
    start = free.text                      # the text of the first k free tokens: found at the k-th
    assert start and len(free.token_ids) == k
    after = {"regex": REGEX, "start_after": start}
    out = demo.generate(prompt, SamplingParams(max_tokens=64, temperature=0, structured_outputs=after),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:k] == free.token_ids and out.finish_reason == "stop"
    assert out.text.startswith(start) and re.fullmatch(REGEX, out.text[len(start):]), out.text
    sampled = demo.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=2, structured_outputs=after),
                            use_tqdm=False)[0].outputs[0]
    at = sampled.text.find(start)          # a draw reaches the start text later, or not at all
    assert at < 0 and sampled.finish_reason == "length" or re.fullmatch(REGEX, sampled.text[at + len(start):])
    spec = LLM(DEMO, device="cpu", show_progress=False, max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    again = spec.generate(prompt, SamplingParams(max_tokens=64, temperature=0, structured_outputs=after),
                          use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids
    with pytest.raises(ValueError, match="structured_outputs.start_after"):
        SamplingParams(structured_outputs={"regex": REGEX, "start_after": ""})
