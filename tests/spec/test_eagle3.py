"""EAGLE-3 heads (ridge/models/eagle3.py, ridge/engine/spec/eagle.py) against an independent
torch reference (tests/spec/eagle3_reference.py) on a tiny random 4-layer Llama target: the
captured target states, the head's logits row for row, every draft the proposer makes while
verification accepts 0..k of them, greedy identity, the sampled distribution and the config
errors."""
import json
import os
import shutil

import pytest
import torch
from tests.spec.eagle3_reference import ReferenceHead, target_states, write_echo_head, write_head
from tests.spec.head_support import (captured_generation, check_head, check_sampled_distribution, splice_drafts,
                                     static_equals_eager)
from tests.spec.spec_support import llm
from tests.tests_support import prompt_of

from ridge import LLM, SamplingParams
from ridge.runner.cuda_graphs import DecodeInputs
from ridge.runner.model_runner import slot_of
from ridge.utils.random_checkpoint import make_random_checkpoint

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [(prompt_of(7, i) * 3)[:17] for i in range(3)] + [prompt_of(21, 5), prompt_of(3, 6)]


def eagle(head, k=3):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(target, head in the original layout, head in the speculators layout, transformers' target,
    the echo head: the target's own distribution one position late)."""
    import transformers
    root = tmp_path_factory.mktemp("eagle3")
    target = make_random_checkpoint(str(root / "target"), num_hidden_layers=4)
    heads = [write_head(str(root / "head"), target), write_head(str(root / "head-spec"), target, "speculators", seed=1)]
    return (target, *heads, transformers.AutoModelForCausalLM.from_pretrained(target).float().eval(),
            write_echo_head(str(root / "echo"), target))


@pytest.fixture(scope="module")
def plain(ckpts):
    return llm(ckpts[0])


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", [1, 2], ids=["eagle", "speculators"])
def test_captured_states_and_head_logits_match_the_reference(ckpts, plain, layout):
    """The target's captured stream is transformers' hidden_states[1, 2, 3] row for row (a prefill
    and decode steps); the head's logits over the target's vocabulary (-inf off the draft ids) and
    its pre-norm output equal the reference's: a prompt's rows, then three chained steps; the
    entries `write_kv` makes without attending serve a later row as the full forward's do."""
    target, head_dir, hf = ckpts[0], ckpts[layout], ckpts[3]
    spec = llm(target, speculative_config=eagle(head_dir))
    prop = spec.engine.speculator.proposer
    toks, seen = captured_generation(spec, PROMPTS[3])
    want = target_states(hf, toks)
    torch.testing.assert_close(seen, want[:-1], atol=1e-5, rtol=1e-5)
    assert not plain.engine.runner.model.model.captures and plain.engine.runner.hidden_sink is None

    ref = ReferenceHead(head_dir, hf.model.embed_tokens.weight.float())
    with torch.inference_mode():
        states = prop.head.fuse(want[:12])
    torch.testing.assert_close(states, ref.fuse(want[:12]), atol=1e-5, rtol=1e-5)
    logits = check_head(prop, ref, toks, states)
    assert torch.isinf(logits).sum(-1).eq(512 - 384).all()


def test_every_draft_is_the_reference_heads_while_verification_accepts_0_to_k(ckpts, plain):
    """The proposer's drafts, at every step of every sequence, equal the reference head's over the
    whole history (transformers' states, no cache): batched and alone-sized prompts, chunked
    prefill, preemption, a prefix hit and n = 2 forks. The drafts are spliced with the true
    continuation so that verification accepts 0, 1, 2 and 3 of them in turn; the outputs are
    plain decoding's and every page comes back."""
    target, head_dir, hf = ckpts[0], ckpts[1], ckpts[3]
    shared = prompt_of(40, 9)
    prompts = [shared + prompt_of(5, i) for i in range(3)] + PROMPTS[3:]
    want = {tuple(p): w for p, w in zip(prompts + PROMPTS[:1],
                                        tokens(plain.generate(prompts + PROMPTS[:1], GREEDY, use_tqdm=False)))}
    spec = llm(target, speculative_config=eagle(head_dir), enable_prefix_caching=True, max_num_batched_tokens=24,
               page_size=8, kv_cache_memory=30 * 8 * 4 * 2 * 2 * 16 * 4)    # 30 pages in each pool: preempts
    prop, ref = spec.engine.speculator.proposer, ReferenceHead(head_dir, hf.model.embed_tokens.weight.float())
    seen = splice_drafts(prop, want, lambda toks, k: ref.drafts(target_states(hf, toks), toks, k))
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == [want[tuple(p)] for p in prompts]
    forked = spec.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [want[tuple(PROMPTS[0])][:12]] * 2
    st = spec.engine.stats()
    assert st.num_preemptions > 0 and st.prompt_tokens < sum(map(len, prompts)) + len(PROMPTS[0])
    assert seen["checked"] > 50 and seen["accepted"] >= {0, 1, 2, 3} and st.spec_num_accepted_tokens > 0
    assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages


def test_greedy_is_plain_decoding_alone_and_batched(ckpts, plain):
    want = tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    for head, alone in ((ckpts[2], PROMPTS[3:]), (ckpts[4], [])):
        spec = llm(ckpts[0], speculative_config=eagle(head, k=4))
        assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert [tokens(spec.generate([p], GREEDY, use_tqdm=False))[0] for p in alone] == want[3:3 + len(alone)]
        assert spec.engine.stats().spec_num_draft_tokens > 0
        assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages
    # penalties: the drafts are drawn from q with the drafts before them counted as output
    rep = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True)
    assert tokens(spec.generate(PROMPTS, rep, use_tqdm=False)) == tokens(plain.generate(PROMPTS, rep, use_tqdm=False))


def test_sampled_distribution_is_the_targets_and_a_wrong_rule_is_caught(ckpts, plain, monkeypatch):
    """The chi-square test of test_speculative.py: the third token of 600 seeded samples has the
    same distribution with EAGLE-3 drafts (k = 2, each drawn from the echo head's q, which the
    target accepts about 40% of the time) as without, and a verification that accepts every
    draft fails it (on 150: it is far off)."""
    check_sampled_distribution(plain, llm(ckpts[0], speculative_config=eagle(ckpts[4], k=2)), monkeypatch, (0.2, 0.8))


def _variant(src: str, dst: str, config=None, drop=(), tensors=None) -> str:
    """A copy of the head at src with its config.json changed and some tensors dropped or replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, **(config or {})}, open(os.path.join(dst, "config.json"), "w"))
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    save_file({**w, **(tensors or {})}, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("change, field", [
    (dict(drop=("d2t",)), "d2t"),                                            # a reduced vocabulary needs its map
    (dict(tensors={"d2t": torch.full((384,), 600)}), "d2t"),                 # ids outside the target's vocabulary
    (dict(config={"target_hidden_size": 96}), "target_hidden_size"),
    (dict(config={"hidden_size": 96}), "hidden_size"),
    (dict(config={"vocab_size": 1024}), "vocab_size"),                      # the target's vocabulary
    (dict(config={"draft_vocab_size": 256}), "draft_vocab_size"),            # the head's tensors disagree
    (dict(config={"draft_vocab_size": 1000}), "draft_vocab_size"),
    (dict(config={"eagle_config": {"use_aux_hidden_state": False}}), "use_aux_hidden_state"),
    (dict(config={"num_hidden_layers": 2}), "num_hidden_layers"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}), "eagle_aux_hidden_state_layer_ids"),
    (dict(tensors={"fc.weight": torch.zeros(64, 128)}), "fc.weight"),
])
def test_bad_heads_are_value_errors_naming_the_field(ckpts, tmp_path, change, field):
    head = _variant(ckpts[1], str(tmp_path / "bad"), **change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(ckpts[0], device="cpu", show_progress=False, max_model_len=128, speculative_config=eagle(head))
    shutil.rmtree(head)


def test_heads_only_draft_for_their_method(ckpts):
    with pytest.raises(ValueError, match="is an EAGLE-3 draft head"):
        LLM(ckpts[1], device="cpu", show_progress=False)
    with pytest.raises(ValueError, match="use method eagle3"):
        LLM(ckpts[0], device="cpu", show_progress=False, speculative_config={
            "method": "draft_model", "model": ckpts[1], "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        LLM(ckpts[0], device="cpu", show_progress=False, speculative_config=eagle(ckpts[0]))
    with pytest.raises(ValueError, match="model"):
        LLM(ckpts[0], device="cpu", show_progress=False, speculative_config={"method": "eagle3",
                                                                             "num_speculative_tokens": 2})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels run on a CPU only under TRITON_INTERPRET=1")
def test_draft_steps_on_the_static_path_equal_the_eager_ones(ckpts):
    """The head on the Triton backend (the interpreter on a CPU): its entries written by the
    rope-and-write kernel, then decode steps through the decode graphs' static buffers (three
    sequences padded to a bucket of four, states read from hidden_in), give the torch backend's
    logits; the path a GPU captures, without the capture."""
    from ridge.config import ModelConfig
    spec = llm(ckpts[0], speculative_config=eagle(ckpts[1]))
    static_equals_eager(spec.engine.speculator.proposer, ckpts[1], ModelConfig.from_dir(ckpts[1]))


def test_item_rows_follow_each_plan_layout():
    """The rows of each scheduled item in the target's outputs (and capture buffer): a decode
    graph's row a sequence, a verify graph's `queries` rows a sequence, the flat batch's starts."""
    from types import SimpleNamespace as NS

    from ridge.runner.model_runner import ModelRunner
    from ridge.runner.step_message import DECODE, EAGER, VERIFY, StepPlan
    runner, sched = NS(verify_graphs=NS(queries=4)), NS(scheduled=[NS(num_new_tokens=1), NS(num_new_tokens=3)])

    def plan(kind, starts=()):
        return StepPlan(kind, DecodeInputs([], [], [], [], []), query_starts=list(starts))
    assert ModelRunner.item_rows(runner, NS(scheduled=sched.scheduled[:1] * 2), plan(DECODE)) == [(0, 1), (1, 1)]
    assert ModelRunner.item_rows(runner, sched, plan(VERIFY)) == [(0, 1), (4, 3)]
    assert ModelRunner.item_rows(runner, sched, plan(EAGER, [0, 1, 4])) == [(0, 1), (1, 3)]
