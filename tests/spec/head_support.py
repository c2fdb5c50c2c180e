"""What the tests of the head proposer's heads (EAGLE-3: test_eagle3.py; MTP: test_mtp.py) share:
the target states the runner captures during a generation, the head's forward, chained steps and
cache writes checked against a reference's `run(next ids, positions, states) -> (logits, pre)`,
and its static decode path (Triton kernels, decode graphs' buffers) against its eager one."""
import dataclasses
from types import SimpleNamespace

import torch

from ridge import SamplingParams
from ridge.runner.cuda_graphs import DecodeInputs
from ridge.runner.model_runner import slot_of


def captured_generation(spec, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], torch.Tensor]:
    """(the prompt and its greedy continuation, the target's captured states of every position
    but the last [n - 1, width]), the states snooped from the runner's hidden sink."""
    prop = spec.engine.speculator.proposer
    seen, record = {}, prop.record

    def snoop(sched, plan, rows):      # a rejected draft's row is overwritten by the next step's first
        for item, (first, n) in zip(sched.scheduled, rows):
            for j in range(n):
                seen[item.start + j] = prop.target.captured[first + j].clone()
        record(sched, plan, rows)
    prop.target.hidden_sink = snoop
    out = spec.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    toks = prompt + out[0].outputs[0].token_ids
    return toks, torch.stack([seen[p] for p in range(len(toks) - 1)])


def check_head(prop, ref, toks: list[int], states: torch.Tensor, T: int = 12) -> torch.Tensor:
    """The head's logits and pre-norm output over rows 0..T-1 (states [T, H], token p + 1 at row
    p) equal the reference's, then three chained steps (the last row's pre and argmax fed back),
    then the same rows with all but the last written by write_kv (the last row's logits unchanged).
    Returns the first forward's logits [T, vocab]."""
    head, runner = prop.head, prop.runner
    with torch.inference_mode():          # the head is called as the runner calls it
        ps, dev = runner.cfg.page_size, runner.to_device
        table = list(range(runner.kv_cache.shape[2] - 4, runner.kv_cache.shape[2]))    # pages no sequence holds
        ids, positions = toks[1:T + 1], list(range(T))
        ref_logits, ref_pre = ref.run(ids, positions, states)
        head.hidden_in[:T].copy_(states)
        meta = runner.metadata([slot_of(table, p, ps) for p in positions], [0, T], [T], [table])
        first = head.compute_logits(head(dev(ids, torch.int64), dev(positions, torch.int64), runner.layer_caches, meta))
        torch.testing.assert_close(first, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.hidden_out[:T], ref_pre, atol=1e-4, rtol=1e-4)
        for j in range(3):
            ids.append(int(ref_logits[-1].argmax()))
            positions.append(T + j)
            states = torch.cat([states, ref_pre[-1:]])
            ref_logits, ref_pre = ref.run(ids, positions, states)
            head.hidden_in[:1].copy_(head.hidden_out[:1] if j else head.hidden_out[T - 1:T])
            got = prop._decode(DecodeInputs(ids[-1:], [T + j], [slot_of(table, T + j, ps)], [T + j + 1], [table]))
            torch.testing.assert_close(got[0], ref_logits[-1], atol=1e-4, rtol=1e-4)
        runner.kv_cache[:, :, table] = 0
        head.write_kv(dev(ids[:T - 1], torch.int64), dev(positions[:T - 1], torch.int64), states[:T - 1],
                      runner.layer_caches, dev([slot_of(table, p, ps) for p in range(T - 1)], torch.int64))
        head.hidden_in[:1].copy_(states[T - 1:T])
        got = prop._decode(DecodeInputs([ids[T - 1]], [T - 1], [slot_of(table, T - 1, ps)], [T], [table]))
        torch.testing.assert_close(got[0], ref.run(ids[:T], positions[:T], states[:T])[0][-1], atol=1e-4, rtol=1e-4)
    return first


def static_equals_eager(eager, model: str, head_cfg) -> None:
    """The head (checkpoint `model`, config `head_cfg`) on the Triton backend (the interpreter on a
    CPU): its entries written by the rope-and-write kernel, then decode steps through the decode
    graphs' static buffers (three sequences padded to a bucket of four, states read from
    hidden_in), give the logits of `eager` (the proposer on the torch backend)."""
    from ridge.config import EngineConfig
    from ridge.engine.spec.eagle import HeadProposer
    from ridge.runner.model_runner import ModelRunner
    cfg = EngineConfig(model=model, attention_backend="triton", max_model_len=32, max_num_seqs=4, page_size=8)
    runner = ModelRunner(dataclasses.replace(cfg, device=torch.device("cpu"), dtype=torch.float32), head_cfg,
                         show_progress=False)
    runner.model.share_embedding(eager.head.embed)
    runner.model.allocate_hidden(4)
    runner.allocate_kv_cache(12)
    runner.setup_decode(use_graphs=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.bucket_for(3) == 4
    lens, tables = [5, 9, 3], [[0, 1], [2, 3], [4, 5]]
    g = torch.Generator().manual_seed(3)
    states = torch.randn(sum(lens) + 3, head_cfg.hidden_size, generator=g)
    ids = torch.randint(3, head_cfg.vocab_size, (sum(lens) + 3,), generator=g).tolist()
    with torch.inference_mode():
        logits = []
        for r in (eager.runner, runner):
            r.kv_cache.zero_()
            ps = r.cfg.page_size
            at, rows, positions, slots = 0, [], [], []
            for n, t in zip(lens, tables):
                rows += range(at, at + n - 1)
                positions += range(n - 1)
                slots += [slot_of(t, p, ps) for p in range(n - 1)]
                at += n
            dev = r.to_device
            r.model.write_kv(dev([ids[i] for i in rows], torch.int64), dev(positions, torch.int64), states[rows],
                             r.layer_caches, dev(slots, torch.int64))
            last = [sum(lens[:i + 1]) - 1 for i in range(3)]
            r.model.hidden_in[:3].copy_(states[last])
            step = DecodeInputs([ids[i] for i in last], [n - 1 for n in lens],
                                [slot_of(t, n - 1, ps) for n, t in zip(lens, tables)], lens, tables)
            logits.append(HeadProposer._decode(SimpleNamespace(runner=r, head=r.model), step).clone())
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def check_sampled_distribution(plain, spec_llm, monkeypatch, accepted: tuple[float, float], n: int = 600) -> None:
    """The chi-square test of test_speculative.py: the third token of n seeded samples has the same
    distribution with the head's drafts (k = 2 each, drawn from its q; the share of them accepted
    within `accepted`) as without, and a verification that accepts every draft fails it (on n / 4:
    it is far off)."""
    from tests.spec.test_speculative import _accept_all, _chi2_quantile, _second_tokens, _two_sample_chi2
    base = _second_tokens(plain, n)
    got = _second_tokens(spec_llm, n)
    st = spec_llm.engine.stats()
    assert st.spec_num_draft_tokens == n and accepted[0] * n < st.spec_num_accepted_tokens < accepted[1] * n
    stat, df = _two_sample_chi2(base, got)
    assert stat < _chi2_quantile(df), (stat, df)

    import ridge.engine.spec.speculator as sp
    monkeypatch.setattr(sp, "verify", lambda drafts, q, p, seeds, steps, greedy, num_draft: _accept_all(drafts, p, num_draft))
    stat, df = _two_sample_chi2(base[:n // 4], _second_tokens(spec_llm, n // 4))
    assert stat > _chi2_quantile(df), (stat, df)


def splice_drafts(prop, want: dict, reference_drafts) -> dict:
    """Wrap the proposer's propose: every sequence's drafts must be `reference_drafts(tokens, k)`'s
    (drafts, top-2 margins; only a near-tie may go the other way, and then both diverge), and are
    then spliced with the true continuation (`want`: prompt tuple -> greedy output) so that
    verification accepts 0, 1, 2, ... of them in turn. Returns the counts it keeps: `checked`
    drafts, the `accepted` run lengths it arranged."""
    propose, seen = prop.propose, {"checked": 0, "accepted": set()}

    def spliced(seqs, limits):
        got = propose(seqs, limits)
        for seq, drafts in zip(seqs, got.tokens):
            toks = list(seq.token_ids)
            ref_drafts, margins = reference_drafts(toks, len(drafts))
            for a, b, m in zip(drafts, ref_drafts, margins):
                if a != b:
                    assert m < 1e-4, (toks, drafts, ref_drafts)
                    break
            seen["checked"] += len(drafts)
            truth = want[tuple(toks[:seq.num_prompt_tokens])][seq.num_output_tokens:]
            a = (seen["checked"] + seq.seq_id) % (len(drafts) + 1)
            seen["accepted"].add(min(a, len(truth)))
            drafts[:a] = truth[:a]
        return got
    prop.propose = spliced
    return seen
