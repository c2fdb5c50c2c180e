"""DeepSeek-V3's MTP layer as a proposer (ridge/models/mtp.py, the head proposer of
ridge/engine/spec/eagle.py) on a tiny random DeepSeek-V3 written by transformers with a random MTP
layer added in the public layout (tests/spec/mtp_reference.py): the captured target states and the
head's logits against an independent torch reference, every draft while verification accepts
0..k of them, greedy identity, the sampled distribution and the config errors."""
import json
import os
import shutil

import pytest
import torch
from tests.spec.head_support import (captured_generation, check_head, check_sampled_distribution, splice_drafts,
                                     static_equals_eager)
from tests.spec.mtp_reference import ReferenceMTP, target_states, write_mtp_layer
from tests.spec.spec_support import llm, tokens
from tests.tests_support import prompt_of

from ridge import LLM, SamplingParams
from ridge.utils.random_checkpoint import make_random_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [(prompt_of(7, i) * 3)[:17] for i in range(2)] + [prompt_of(21, 5), prompt_of(3, 6)]


def mtp(k=3, method="mtp"):
    return {"method": method, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(target with a random MTP layer, transformers' target, target with an echo MTP layer, the
    target without one)."""
    import transformers
    root = tmp_path_factory.mktemp("mtp")
    bare = make_random_checkpoint(str(root / "bare"), arch="deepseekv3")
    target, echo = (shutil.copytree(bare, str(root / n)) for n in ("target", "echo"))
    write_mtp_layer(target)
    write_mtp_layer(echo, seed=1, echo=0.7)
    return target, transformers.AutoModelForCausalLM.from_pretrained(bare).float().eval(), echo, bare


@pytest.fixture(scope="module")
def plain(ckpts):
    return llm(ckpts[3])


def test_captured_states_and_head_logits_match_the_reference(ckpts):
    """The target's captured state is transformers' final normed hidden state row for row (a
    prefill and decode steps); the head's logits and pre-norm output equal the reference's: a
    prompt's rows, then three chained steps; the entries `write_kv` makes without attending serve
    a later row as the full forward's do."""
    target, hf = ckpts[0], ckpts[1]
    spec = llm(target, speculative_config=mtp())
    prop = spec.engine.speculator.proposer
    toks, seen = captured_generation(spec, PROMPTS[2])
    want = target_states(hf, toks)
    torch.testing.assert_close(seen, want[:-1], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        states = prop.head.fuse(want[:12])
    assert torch.equal(states, want[:12])               # the states are the layer's input as they are
    assert check_head(prop, ReferenceMTP(target), toks, states).shape == (12, 512)     # the full vocabulary


def test_every_draft_is_the_reference_layers_while_verification_accepts_0_to_k(ckpts, plain):
    """The proposer's drafts, at every step of every sequence, equal the reference's over the whole
    history (transformers' states, no cache), with chunked prefill and the drafts spliced with the
    true continuation so that verification accepts 0, 1, 2 and 3 of them in turn; the outputs are
    plain decoding's and every page comes back."""
    target, hf = ckpts[0], ckpts[1]
    want = {tuple(p): w for p, w in zip(PROMPTS, tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False)))}
    spec = llm(target, speculative_config=mtp(), max_num_batched_tokens=24, page_size=8)
    prop, ref = spec.engine.speculator.proposer, ReferenceMTP(target)
    seen = splice_drafts(prop, want, lambda toks, k: ref.drafts(target_states(hf, toks), toks, k))
    assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == [want[tuple(p)] for p in PROMPTS]
    st = spec.engine.stats()
    assert seen["checked"] > 20 and seen["accepted"] >= {0, 1, 2, 3} and st.spec_num_accepted_tokens > 0
    assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages


def test_greedy_is_plain_decoding_alone_and_batched(ckpts, plain):
    want = tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    for target, method in ((ckpts[0], "mtp"), (ckpts[2], "deepseek_mtp")):
        spec = llm(target, speculative_config=mtp(4, method), enable_prefix_caching=True)
        assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert [tokens(spec.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS[2:]] == want[2:]
        st = spec.engine.stats()
        assert st.spec_num_draft_tokens > 0 and st.spec_method == "mtp"
        assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages
    assert st.spec_num_accepted_tokens > 0              # the echo layer's drafts are accepted


def test_sampled_distribution_is_the_targets_and_a_wrong_rule_is_caught(ckpts, plain, monkeypatch):
    """The chi-square test of test_speculative.py: the third token of 600 seeded samples has the
    same distribution with MTP drafts (k = 2, each drawn from the echo layer's q, which the target
    often accepts) as without, and a verification that accepts every draft fails it."""
    check_sampled_distribution(plain, llm(ckpts[2], speculative_config=mtp(2)), monkeypatch, (0.1, 0.9))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels run on a CPU only under TRITON_INTERPRET=1")
def test_draft_steps_on_the_static_path_equal_the_eager_ones(ckpts):
    """The MTP head on the Triton backend: its latent entries written by the rope-and-write
    kernel (write_kv), decode steps through the static buffers and the absorbed decode kernel,
    give the torch backend's logits."""
    from ridge.config import ModelConfig
    spec = llm(ckpts[0], speculative_config=mtp())
    static_equals_eager(spec.engine.speculator.proposer, ckpts[0], ModelConfig.from_dir(ckpts[0]).mtp_head())


def _with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    json.dump({**cfg, **changes}, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_bad_configs_are_value_errors_naming_the_problem(ckpts, checkpoints, tmp_path):
    def engine(target, **spec):
        return LLM(target, device="cpu", show_progress=False, max_model_len=128, speculative_config={**mtp(), **spec})
    with pytest.raises(ValueError, match="DeepSeek-V3-style.*LlamaForCausalLM has none"):
        engine(checkpoints("llama"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        engine(_with_config(ckpts[0], str(tmp_path / "none"), num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        engine(_with_config(ckpts[0], str(tmp_path / "missing"), num_nextn_predict_layers=None))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\."):
        engine(ckpts[3])                                # the config says one layer, the checkpoint has none
    with pytest.raises(ValueError, match="only they take one"):
        engine(ckpts[0], model=ckpts[0])
    with pytest.raises(ValueError, match="method must be one of"):
        engine(ckpts[0], method="mtp2")
