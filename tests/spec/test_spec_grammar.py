"""Speculative decoding under a grammar (structured outputs; ridge/engine/structured.py's draft
walk, speculator.plan's cut, verify's per-position masks, the draft model's masked q), on the demo
pair, CPU: greedy outputs equal plain decoding's for ngram and the draft model with drafts proposed
and accepted for the constrained sequences (logprobs too); every output parses; a grammar that
ends inside a run of drafts ends the sequence there; sampled runs stay within the grammar, and the
target as its own draft reproduces seeded sampling; preemption, prefix hits and the overlapped
decode path keep the identity; the mask walk leaves a matcher where it found it."""
import json
import os
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.spec.proposer import Proposal
from ridge.engine.structured import Grammars, StructuredOutputsParams, allowed_drafts, fill_run_bitmask
from tests.engine.test_structured_outputs import CHOICE, GRAMMAR, REGEX, SCHEMA

DEMO = demo_model_path()
DRAFT = os.path.join(os.path.dirname(DEMO), "demo-code-3m")
CONFIGS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
           "draft": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}}
VALUES = {"json": SCHEMA, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR}
# prompts whose context holds text of the kind, so that prompt lookup finds drafts
PROMPTS = {"json": 'x = {"name": "point", "size": 12, "tags": ["a", "b"]}\ny = {"name": "line", "size": 3, '
                   '"tags": ["c"]}\nz = ',
           "regex": "ids:\nbj_032\nbj_232\ngroup_164\n",
           "choice": 'Answer "yes", "no" or "it depends": it depends\nAnswer: ',
           "grammar": "t = (12,7,9)\nu = (12,7,9)\nv = "}
FREE = "def parse(path):"


def constrained(kind, **kw):
    return SamplingParams(structured_outputs={kind: VALUES[kind]}, **{"max_tokens": 48, "temperature": 0, **kw})


def check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(r"\([1-9][0-9]*(,[1-9][0-9]*)*\)", text), text


def llm(spec=None, **kw):
    """An engine whose speculating sequences draft at every step and batch size (whether drafts pay
    on this machine is the clock's own test)."""
    engine_llm = LLM(DEMO, device="cpu", show_progress=False, max_model_len=256, speculative_config=spec, **kw)
    sp = engine_llm.engine.speculator
    if sp is not None:
        sp.cutoff = engine_llm.engine.cfg.max_num_seqs
        sp.clock.pays, sp.clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)
    return engine_llm


@pytest.fixture(scope="module")
def plain():
    return llm()


@pytest.fixture(scope="module")
def greedy_batch(plain):
    """The mixed batch (one constrained prompt of each kind, one free) and plain decoding's outputs.
    The regex request asks for logprobs: while it runs, verify steps take the general path (target
    distributions), after it the all-greedy one (argmax)."""
    prompts = [PROMPTS[k] for k in VALUES] + [FREE]
    params = [constrained(k, **({"logprobs": 2} if k == "regex" else {})) for k in VALUES] + \
        [SamplingParams(max_tokens=16, temperature=0)]
    return prompts, params, [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]


def test_the_mask_walk_leaves_the_matcher_where_it_found_it():
    """fill_run_bitmask's row i is the mask after drafts[:i] (as a matcher fed them for good gives),
    it stops after a draft the grammar rejects or ends on, and the matcher's state after the walk is
    its state before; allowed_drafts counts the same prefix."""
    tok = AutoTokenizer.from_pretrained(DEMO)
    grammars = Grammars(tok, 8192, [1])
    enc = lambda text: tok.encode(text, add_special_tokens=False)    # noqa: E731
    so = StructuredOutputsParams(json=SCHEMA)
    committed, drafts = enc('{"name": "'), enc('ab", "size": 1')
    m = grammars.matcher(so)
    for t in committed:
        assert m.accept_token(t)
    before = torch.zeros(1, 256, dtype=torch.int32)
    m.fill_next_token_bitmask(before)
    bitmask = torch.full((len(drafts) + 3, 256), -1, dtype=torch.int32)
    assert fill_run_bitmask(m, drafts, bitmask, 2) == len(drafts) + 1
    assert (bitmask[:2] == -1).all()
    for i in range(len(drafts) + 1):
        fresh, want = grammars.matcher(so), torch.zeros(1, 256, dtype=torch.int32)
        assert all(fresh.accept_token(t) for t in committed + drafts[:i])
        fresh.fill_next_token_bitmask(want)
        assert torch.equal(bitmask[2 + i], want[0]), i
    after = torch.zeros(1, 256, dtype=torch.int32)
    m.fill_next_token_bitmask(after)
    assert torch.equal(after, before) and allowed_drafts(m, drafts) == len(drafts)

    bad = drafts[:2] + enc("}") + drafts[2:]                # '}' cannot close a string
    assert allowed_drafts(m, bad) == 2 and fill_run_bitmask(m, bad, bitmask, 0) == 3
    m.fill_next_token_bitmask(after)
    assert torch.equal(after, before)
    choice = grammars.matcher(StructuredOutputsParams(choice=CHOICE))
    ends = enc("no") + [1] + enc("yes")                     # the end of the grammar, then more
    bitmask.fill_(-1)
    assert allowed_drafts(choice, ends) == 2 and fill_run_bitmask(choice, ends, bitmask, 0) == 2
    assert (bitmask[2:] == -1).all() and not choice.is_terminated()
    assert all(choice.accept_token(t) for t in enc("it depends") + [1]) and choice.is_terminated()


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_under_grammars_is_plain_decoding_with_drafts_accepted(proposer, greedy_batch):
    """A batch of every kind and a free request: the tokens plain decoding gives, every constrained
    output parses, and the constrained sequences took drafts the target accepted. A draft model's
    raw proposals (before plan's cut) already lie within the grammar: its q is masked."""
    prompts, params, want = greedy_batch
    spec = llm(CONFIGS[proposer])
    sp = spec.engine.speculator
    propose, outside = sp.proposer.propose, []

    def checked(seqs, limits):
        out = propose(seqs, limits)
        outside.extend(s.seq_id for s, t in zip(seqs, out.tokens)
                       if s.grammar is not None and allowed_drafts(s.grammar, t) < len(t))
        return out
    sp.proposer.propose = checked
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == \
        [(w.token_ids, w.finish_reason) for w in want]
    for kind, o in zip(VALUES, outs):
        check(kind, o.outputs[0].text)
        assert o.outputs[0].finish_reason == "stop"
    for a, b in zip(outs[1].outputs[0].logprobs, want[1].logprobs):     # the constrained distribution's
        assert a.keys() == b.keys()      # a forced token's runner-up is -inf in both
        assert all(a[t].logprob == b[t].logprob or abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    drafted = [o.metrics.num_draft_tokens for o in outs[:len(VALUES)]]
    accepted = [o.metrics.num_accepted_tokens for o in outs[:len(VALUES)]]
    # every kind drafts (json, the longest, has most of its tokens accepted; the others a few)
    assert all(drafted) and accepted[0] > 0 and sum(accepted) >= len(VALUES), (drafted, accepted)
    if proposer == "draft":
        assert not outside
    assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages


class Oracle:
    """Drafts a scripted continuation: `script(seq)` gives the tokens after the sequence's own."""
    masks_grammar = True      # point masses

    def __init__(self, script):
        self.script = script

    def propose(self, seqs, limits):
        return Proposal([self.script(s)[:lim] for s, lim in zip(seqs, limits)])

    def release(self, seq_ids):
        pass


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_that_ends_inside_the_drafts_ends_the_sequence_there(plain, ignore_eos):
    """Drafts that run on past the grammar's end (its stop token, then more text) and drafts with a
    token the grammar rejects in the middle: the output is plain decoding's, ending at the grammar's
    end ("stop"; with ignore_eos the grammar's end stops it, not the stop token), the drafts after
    the end or the rejected token are never verified, those before it are all accepted."""
    prompt, params = PROMPTS["json"], constrained("json", ignore_eos=ignore_eos)
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert want.token_ids[-1] == 1 and want.finish_reason == "stop"
    tok = plain.engine.tokenizer
    junk = tok.encode("\nw = 1", add_special_tokens=False)
    bad = tok.encode(" ]]", add_special_tokens=False)[0]
    n_prompt = len(tok.encode(prompt))

    def past_the_end(seq):      # the rest of the output, then text after its end
        return want.token_ids[seq.num_tokens - n_prompt:] + junk

    def with_a_bad_token(seq):  # three right tokens, then one the grammar rejects, then right ones
        rest = want.token_ids[seq.num_tokens - n_prompt:]
        return rest[:3] + [bad] + rest[3:]
    for script in (past_the_end, with_a_bad_token):
        spec = llm({**CONFIGS["ngram"], "num_speculative_tokens": 6})
        spec.engine.speculator.proposer = Oracle(script)
        out = spec.generate(prompt, params, use_tqdm=False)[0]
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (want.token_ids, "stop")
        m = out.metrics
        assert m.num_draft_tokens == m.num_accepted_tokens > 0
        if script is past_the_end:
            # the prefill's token, then verify steps of every draft up to the end and the target's
            # own, whose last one (after the end) is dropped: no draft after the end was verified
            assert len(want.token_ids) == 1 + m.num_draft_tokens + m.num_drafts - 1
        else:
            assert m.num_draft_tokens <= 3 * m.num_drafts     # cut before the rejected token
        assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_outputs_under_grammars_stay_within_them(proposer):
    """Seeded sampling at temperature 1 with n = 2: every sample parses and ends at its grammar's
    end, drafts were accepted, and a seeded request gives the same tokens alone as in the batch."""
    spec = llm(CONFIGS[proposer])
    kinds = ["json", "regex", "grammar"]
    params = [constrained(k, temperature=1.0, seed=i, n=2, max_tokens=64) for i, k in enumerate(kinds)]
    outs = spec.generate([PROMPTS[k] for k in kinds], params, use_tqdm=False)
    for kind, o in zip(kinds, outs):
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            check(kind, c.text)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    alone = spec.generate(PROMPTS["json"], params[0], use_tqdm=False)[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in outs[0].outputs]


def test_greedy_under_grammars_across_preemption_and_prefix_hits_with_drafts(plain):
    """A tight cache (preemption), prefix caching (the shared example is hit) and small chunks,
    the draft model proposing: plain decoding's tokens, drafts accepted, and every page (the
    target's and the draft's) back at the end."""
    prompts = [PROMPTS["json"] + s for s in ("", "a = ", "b = ", "c = ")] + [PROMPTS["grammar"]] * 2
    params = [constrained("json")] * 4 + [constrained("grammar"), constrained("grammar", n=2)]
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = llm(CONFIGS["draft"], enable_prefix_caching=True, max_num_batched_tokens=32, page_size=8,
               kv_cache_memory=24 * 2 * 6 * 8 * 2 * 64 * 4)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    st = spec.engine.stats()
    assert st.num_preemptions > 0 and st.prompt_tokens < sum(len(spec.engine.tokenizer.encode(p)) for p in prompts)
    assert st.spec_num_accepted_tokens > 0 and st.num_free_pages == st.num_pages
    spec.engine.speculator.plan([])                 # nothing runs: the draft's state goes
    draft = spec.engine.speculator.proposer
    assert not draft.states and draft.pages.num_free_pages == draft.pages.num_pages


def test_a_draft_identical_to_the_target_reproduces_seeded_sampling_under_grammars(plain):
    """The target as its own draft model, sampling at temperature 1: q masked like p at every
    position is p, so every draft is accepted and the seeded output is plain sampling's, token for
    token; with a wrong per-position mask on either side drafts would be rejected or tokens differ."""
    kinds = ["json", "regex", "grammar"]
    params = [constrained(k, temperature=1.0, seed=i, max_tokens=40) for i, k in enumerate(kinds)]
    prompts = [PROMPTS[k] for k in kinds]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = llm({"method": "draft_model", "model": DEMO, "num_speculative_tokens": 3})
    spec.engine.speculator.draft_cost = 0.0         # a draft this dear would not pay: draft anyway
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for kind, o in zip(kinds, outs):
        check(kind, o.outputs[0].text)
        assert o.metrics.num_draft_tokens == o.metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_speculation_under_grammars_beside_the_overlapped_decode_path():
    """Async scheduling with speculation (the Triton interpreter's static decode path): the step
    clock's probe runs plain steps first, overlapped, constrained rows sampled after the previous
    ids reach their matchers; then drafting steps, synchronous. The greedy outputs equal fully
    synchronous steps', the constrained sequences took drafts, and every page comes back."""
    prompts = [PROMPTS["regex"], PROMPTS["grammar"], FREE]
    params = [constrained("regex", max_tokens=12), constrained("grammar", max_tokens=12),
              SamplingParams(max_tokens=12, temperature=0)]
    runs = {}
    for overlap in (False, True):
        engine_llm = LLM("demo-code-3m", device="cpu", show_progress=False, max_model_len=48, max_num_seqs=4,
                         attention_backend="triton", async_scheduling=overlap, speculative_config=CONFIGS["ngram"])
        engine_llm.engine.speculator.cutoff = 4       # the clock decides, not this machine's ceilings
        outs = engine_llm.generate(prompts, params, use_tqdm=False)
        runs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        check("regex", outs[0].outputs[0].text)
        check("grammar", outs[1].outputs[0].text)
        st = engine_llm.engine.stats()
        assert (st.num_overlapped_steps > 0) == overlap
        assert sum(o.metrics.num_drafts for o in outs[:2]) > 0
        assert st.num_free_pages == st.num_pages and not engine_llm.engine.has_unfinished()
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_gpu_speculation_under_grammars(proposer):
    """On the GPU (bf16, Triton kernels, verify and decode graphs; the masks filled in pinned memory
    and applied on the device): every constrained output parses and ends at its grammar's end, drafts
    were accepted, and greedy tokens follow plain decoding's (a verify step's logits come from other
    kernels than a decode step's, so a near-tie may flip late in a run, never early)."""
    kw = dict(dtype="bfloat16", kv_cache_memory=1 << 28, max_model_len=512)
    prompts = [PROMPTS[k] for k in VALUES] + [FREE]
    params = [constrained(k) for k in VALUES] + [SamplingParams(max_tokens=16, temperature=0)]
    with LLM(DEMO, show_progress=False, **kw) as plain_llm:
        want = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    with LLM(DEMO, show_progress=False, speculative_config=CONFIGS[proposer], **kw) as spec:
        sp = spec.engine.speculator
        sp.cutoff, sp.clock.pays, sp.clock.overhead = 8, (lambda b: True), (lambda b, draft_cost=0.0: None)
        outs = spec.generate(prompts, params, use_tqdm=False)
        sampled = spec.generate(prompts[:3], [constrained(k, temperature=1.0, seed=5) for k in list(VALUES)[:3]],
                                use_tqdm=False)
    for kind, o in zip(VALUES, outs):
        assert o.outputs[0].finish_reason == "stop"
        check(kind, o.outputs[0].text)
    for kind, o in zip(VALUES, sampled):       # a sampled JSON may run to max_tokens: parse what ended
        if o.outputs[0].finish_reason == "stop":
            check(kind, o.outputs[0].text)
    for o, w in zip(outs, want):
        assert o.outputs[0].token_ids[:8] == w[:8]
    assert sum(o.metrics.num_accepted_tokens for o in outs[:len(VALUES)]) > 0
