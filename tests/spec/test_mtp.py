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
from tests.spec.mtp_reference import ReferenceMTP, target_states, write_mtp_layer
from tests.spec.spec_support import llm, tokens
from tests.spec.test_speculative import _accept_all, _chi2_quantile, _second_tokens, _two_sample_chi2
from tests.tests_support import prompt_of

from ridge import LLM, SamplingParams
from ridge.runner.cuda_graphs import DecodeInputs
from ridge.runner.model_runner import slot_of
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
    seen, record = {}, prop.record

    def snoop(sched, plan, rows):
        for item, (first, n) in zip(sched.scheduled, rows):
            for j in range(n):
                seen[item.start + j] = prop.target.captured[first + j].clone()
        record(sched, plan, rows)
    prop.target.hidden_sink = snoop
    prompt = PROMPTS[2]
    out = spec.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    toks = prompt + out[0].outputs[0].token_ids
    want = target_states(hf, toks)
    torch.testing.assert_close(torch.stack([seen[p] for p in range(len(toks) - 1)]), want[:-1], atol=1e-5, rtol=1e-5)

    ref, head, runner = ReferenceMTP(target), prop.head, prop.runner
    with torch.inference_mode():
        T, ps, dev = 12, runner.cfg.page_size, runner.to_device
        table = list(range(runner.kv_cache.shape[2] - 4, runner.kv_cache.shape[2]))    # pages no sequence holds
        states = head.fuse(want[:T])
        ids, positions = toks[1:T + 1], list(range(T))
        ref_logits, ref_pre = ref.run(ids, positions, states)
        head.hidden_in[:T].copy_(states)
        meta = runner.metadata([slot_of(table, p, ps) for p in positions], [0, T], [T], [table])
        logits = head.compute_logits(head(dev(ids, torch.int64), dev(positions, torch.int64), runner.layer_caches, meta))
        assert logits.shape == (T, 512)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.hidden_out[:T], ref_pre, atol=1e-4, rtol=1e-4)
        for j in range(3):                              # chained: the last row's pre and argmax fed back
            ids.append(int(ref_logits[-1].argmax()))
            positions.append(T + j)
            states = torch.cat([states, ref_pre[-1:]])
            ref_logits, ref_pre = ref.run(ids, positions, states)
            head.hidden_in[:1].copy_(head.hidden_out[:1] if j else head.hidden_out[T - 1:T])
            got = prop._decode(DecodeInputs(ids[-1:], [T + j], [slot_of(table, T + j, ps)], [T + j + 1], [table]))
            torch.testing.assert_close(got[0], ref_logits[-1], atol=1e-4, rtol=1e-4)
        runner.kv_cache[:, :, table] = 0                # rows written by write_kv: the last row's logits unchanged
        head.write_kv(dev(ids[:T - 1], torch.int64), dev(positions[:T - 1], torch.int64), states[:T - 1],
                      runner.layer_caches, dev([slot_of(table, p, ps) for p in range(T - 1)], torch.int64))
        head.hidden_in[:1].copy_(states[T - 1:T])
        got = prop._decode(DecodeInputs([ids[T - 1]], [T - 1], [slot_of(table, T - 1, ps)], [T], [table]))
        torch.testing.assert_close(got[0], ref.run(ids[:T], positions[:T], states[:T])[0][-1], atol=1e-4, rtol=1e-4)


def test_every_draft_is_the_reference_layers_while_verification_accepts_0_to_k(ckpts, plain):
    """The proposer's drafts, at every step of every sequence, equal the reference's over the whole
    history (transformers' states, no cache), with chunked prefill and the drafts spliced with the
    true continuation so that verification accepts 0, 1, 2 and 3 of them in turn; the outputs are
    plain decoding's and every page comes back."""
    target, hf = ckpts[0], ckpts[1]
    want = {tuple(p): w for p, w in zip(PROMPTS, tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False)))}
    spec = llm(target, speculative_config=mtp(), max_num_batched_tokens=24, page_size=8)
    prop, ref = spec.engine.speculator.proposer, ReferenceMTP(target)
    propose, checked, accepted = prop.propose, [0], set()

    def spliced(seqs, limits):
        got = propose(seqs, limits)
        for seq, drafts in zip(seqs, got.tokens):
            toks = list(seq.token_ids)
            assert drafts == ref.drafts(target_states(hf, toks), toks, len(drafts)), toks
            checked[0] += len(drafts)
            truth = want[tuple(toks[:seq.num_prompt_tokens])][seq.num_output_tokens:]
            a = (checked[0] + seq.seq_id) % (len(drafts) + 1)
            accepted.add(min(a, len(truth)))
            drafts[:a] = truth[:a]
        return got
    prop.propose = spliced
    assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == [want[tuple(p)] for p in PROMPTS]
    st = spec.engine.stats()
    assert checked[0] > 20 and accepted >= {0, 1, 2, 3} and st.spec_num_accepted_tokens > 0
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
    n = 600
    base = _second_tokens(plain, n)
    spec_llm = llm(ckpts[2], speculative_config=mtp(2))
    got = _second_tokens(spec_llm, n)
    st = spec_llm.engine.stats()
    assert st.spec_num_draft_tokens == n and 0.1 * n < st.spec_num_accepted_tokens < 0.9 * n
    stat, df = _two_sample_chi2(base, got)
    assert stat < _chi2_quantile(df), (stat, df)

    import ridge.engine.spec.speculator as sp
    monkeypatch.setattr(sp, "verify", lambda drafts, q, p, seeds, steps, greedy, num_draft: _accept_all(drafts, p, num_draft))
    stat, df = _two_sample_chi2(base[:n // 4], _second_tokens(spec_llm, n // 4))
    assert stat > _chi2_quantile(df), (stat, df)


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
