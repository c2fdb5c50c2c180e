"""Speculative rejection sampling: greedy identity, exactness of the emitted distribution (and that
plausible wrong rules fail the same check), seeded determinism across batch compositions, sampling
parameters, argument checks. All on the CPU in a few seconds."""
import pytest
import torch

from ridge.layers.sampler import SamplingBatch, sample
from ridge.engine.spec.rejection import draft_probs, sample_probs, target_probs, verify


def make_batch(n, vocab, *, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, seeds=None, steps=None,
               outputs=None, seen=None, freq=0.0, pres=0.0, rep=1.0):
    """A SamplingBatch of n rows; `outputs` / `seen` (lists of token lists) turn penalties on."""
    def full(v, dtype=torch.float32):
        return torch.as_tensor(v, dtype=dtype).expand(n).clone()
    counts = seen_mask = None
    if outputs is not None:
        counts = torch.zeros(n, vocab)
        for r, out in enumerate(outputs):
            for t in out:
                counts[r, t] += 1
    if seen is not None:
        seen_mask = torch.zeros(n, vocab, dtype=torch.bool)
        for r, toks in enumerate(seen):
            seen_mask[r, list(toks)] = True
    return SamplingBatch(
        temperature=full(temperature), top_k=full(vocab if top_k is None else top_k, torch.int64),
        top_p=full(top_p), min_p=full(min_p),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + 11 if seeds is None else seeds,
        steps=torch.zeros(n, dtype=torch.int64) if steps is None else steps,
        presence_penalty=full(pres), frequency_penalty=full(freq), repetition_penalty=full(rep),
        output_counts=counts, seen_mask=seen_mask, banned=None, max_logprobs=-1)


# ---- a bigram "model": next-token logits are a row of a table indexed by the last token --------

def decode_plain(table, prompts, length, **params):
    """Reference: one token a step through ridge's sampler."""
    outs = [[] for _ in prompts]
    for _ in range(length):
        b = make_batch(len(prompts), table.shape[0], steps=torch.tensor([len(o) for o in outs]), outputs=outs,
                       seen=[p + o for p, o in zip(prompts, outs)], **params)
        tok, _ = sample(table[torch.tensor([(p + o)[-1] for p, o in zip(prompts, outs)])], b)
        for o, t in zip(outs, tok.tolist()):
            o.append(t)
    return outs


def decode_speculative(target, draft, prompts, length, k, **params):
    """Draft k tokens with the draft table, verify them with the target table, repeat."""
    n, vocab = len(prompts), target.shape[0]
    outs, stats = [[] for _ in prompts], {"accepted": 0, "proposed": 0}
    while min(len(o) for o in outs) < length:
        drafted, qs = [[] for _ in prompts], []
        for i in range(k):
            ctx = [o + d for o, d in zip(outs, drafted)]
            b = make_batch(n, vocab, steps=torch.tensor([len(c) for c in ctx]), outputs=ctx,
                           seen=[p + c for p, c in zip(prompts, ctx)], **params)
            q = draft_probs(draft[torch.tensor([(p + c)[-1] for p, c in zip(prompts, ctx)])], b)
            for d, x in zip(drafted, sample_probs(q, b.seeds, b.steps).tolist()):
                d.append(x)
            qs.append(q)
        b = make_batch(n, vocab, steps=torch.tensor([len(o) for o in outs]), outputs=outs,
                       seen=[p + o for p, o in zip(prompts, outs)], **params)
        drafts = torch.tensor(drafted)
        lasts = torch.tensor([[(p + o)[-1]] + d for p, o, d in zip(prompts, outs, drafted)])
        p = target_probs(target[lasts], b, drafts)
        tokens, emitted = verify(drafts, torch.stack(qs, 1), p, b.seeds, b.steps, b.temperature == 0)
        for o, row, m in zip(outs, tokens.tolist(), emitted.tolist()):
            assert all(t >= 0 for t in row[:m]) and all(t == -1 for t in row[m:])
            o.extend(row[:m])
        stats["accepted"] += int((emitted - 1).sum())
        stats["proposed"] += n * k
    return [o[:length] for o in outs], stats


PROMPTS = [[1, 2, 3], [4], [5, 5, 6], [7, 0], [2], [3, 9, 11]]


def test_greedy_speculation_is_plain_greedy_decoding():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(16, 16, generator=g) * 3
    draft = target + torch.randn(16, 16, generator=g) * 2      # agrees often, not always
    ref = decode_plain(target, PROMPTS, 24, temperature=0.0)
    got, stats = decode_speculative(target, draft, PROMPTS, 24, k=3, temperature=0.0)
    assert got == ref
    assert 0 < stats["accepted"] < stats["proposed"]            # both branches were exercised


def test_draft_equal_to_target_reproduces_seeded_plain_sampling_with_penalties():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(16, 16, generator=g) * 2
    params = dict(temperature=0.9, top_p=0.95, freq=0.4, pres=0.2, rep=1.3)
    ref = decode_plain(target, PROMPTS, 20, **params)
    got, stats = decode_speculative(target, target, PROMPTS, 20, k=4, **params)
    assert got == ref
    assert stats["accepted"] == stats["proposed"]


def test_identical_proposals_are_always_accepted():
    g = torch.Generator().manual_seed(2)
    n, k, vocab = 64, 4, 32
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=g), -1)
    seeds, first = torch.arange(n) * 3 + 1, torch.randint(0, 100, (n,), generator=g)
    drafts = torch.stack([sample_probs(p[:, i], seeds, first + i) for i in range(k)], 1)
    tokens, emitted = verify(drafts, p[:, :k], p, seeds, first, torch.zeros(n, dtype=torch.bool))
    assert (emitted == k + 1).all() and torch.equal(tokens[:, :k], drafts)
    # a point-mass proposal the target is certain of is accepted too (n-gram style, q = None)
    sure = torch.zeros(n, k + 1, vocab).scatter_(-1, torch.cat([drafts, drafts[:, :1]], 1)[..., None], 1.0)
    tokens, emitted = verify(drafts, None, sure, seeds, first, torch.zeros(n, dtype=torch.bool))
    assert (emitted == k + 1).all() and torch.equal(tokens[:, :k], drafts)


# ---- exactness: the emitted tokens are distributed as the target's p ----------------------------

V, ROWS = 8, 20000
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
Q = torch.tensor([0.02, 0.05, 0.05, 0.08, 0.10, 0.20, 0.25, 0.25])   # deliberately unlike P


def chi_square(tokens, p):
    counts = torch.bincount(tokens, minlength=len(p)).float()
    expected = p * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_LIMIT = 30.0   # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; the seeds are fixed, so no flakes


def spec_round(p=P, q=Q, k=2):
    seeds, first = torch.arange(ROWS) * 2654435761 + 5, torch.arange(ROWS) % 97
    pt = p.expand(ROWS, k + 1, V).contiguous()
    qt = q.expand(ROWS, k, V).contiguous()
    drafts = torch.stack([sample_probs(qt[:, i], seeds, first + i) for i in range(k)], 1)
    return drafts, qt, pt, seeds, first


def test_emitted_tokens_follow_the_target_distribution():
    drafts, qt, pt, seeds, first = spec_round()
    tokens, emitted = verify(drafts, qt, pt, seeds, first, torch.zeros(ROWS, dtype=torch.bool))
    assert chi_square(drafts[:, 0], Q) < CHI2_LIMIT              # the drafts really are from q
    assert chi_square(tokens[:, 0], P) < CHI2_LIMIT
    assert chi_square(tokens[emitted >= 2, 1], P) < CHI2_LIMIT   # later positions too
    accept_rate = float((emitted >= 2).float().mean())
    assert abs(accept_rate - float(torch.minimum(P, Q).sum())) < 0.02
    # point-mass proposals: always propose the token p likes least
    fixed = torch.full((ROWS, 2), 7)
    tokens, _ = verify(fixed, None, pt, seeds, first, torch.zeros(ROWS, dtype=torch.bool))
    assert chi_square(tokens[:, 0], P) < CHI2_LIMIT


def test_wrong_acceptance_rules_fail_the_same_check():
    drafts, qt, pt, seeds, first = spec_round(k=1)
    x = drafts[:, 0]
    u = torch.rand(ROWS, generator=torch.Generator().manual_seed(3))
    resample_p = sample_probs(pt[:, 0], seeds ^ 0x1234, first)
    always_accept = x
    assert chi_square(always_accept, P) > 20 * CHI2_LIMIT
    # right acceptance test, but a rejection redraws from p instead of the residual max(p - q, 0)
    ratio_no_residual = torch.where(u * Q[x] < P[x], x, resample_p)
    assert chi_square(ratio_no_residual, P) > 20 * CHI2_LIMIT
    tokens, _ = verify(drafts, qt, pt, seeds, first, torch.zeros(ROWS, dtype=torch.bool))
    assert chi_square(tokens[:, 0], P) < CHI2_LIMIT


def test_sampling_parameters_shape_both_distributions():
    logits = torch.log(P).expand(ROWS, 3, V)
    draft_logits = torch.log(Q).expand(ROWS, 2, V)
    drafts, _, _, seeds, first = spec_round()
    plain = torch.zeros(ROWS, dtype=torch.bool)
    # top-k 2: nothing outside the target's two best tokens is ever emitted, and those two keep their ratio
    b = make_batch(ROWS, V, top_k=2, seeds=seeds, steps=first)
    p, q = target_probs(logits, b), draft_probs(draft_logits, b)
    assert torch.allclose(p[0, 0], torch.tensor([0.6, 0.4, 0, 0, 0, 0, 0, 0]))
    assert torch.equal((q[0, 0] > 0).nonzero().flatten(), torch.tensor([6, 7]))
    drafts = torch.stack([sample_probs(q[:, i], seeds, first + i) for i in range(2)], 1)
    tokens, _ = verify(drafts, q, p, seeds, first, plain)
    assert int(tokens[:, 0].max()) <= 1
    assert chi_square(tokens[:, 0], p[0, 0][:2]) < CHI2_LIMIT
    # a cold temperature concentrates p on its argmax; a hot one flattens it
    for temperature, lo, hi in ((0.05, 0.999, 1.0), (5.0, 0.12, 0.25)):
        b = make_batch(ROWS, V, temperature=temperature, seeds=seeds, steps=first)
        p, q = target_probs(logits, b), draft_probs(draft_logits, b)
        assert torch.allclose(p[0, 0], torch.softmax(torch.log(P) / temperature, -1), atol=1e-6)
        drafts = torch.stack([sample_probs(q[:, i], seeds, first + i) for i in range(2)], 1)
        tokens, _ = verify(drafts, q, p, seeds, first, plain)
        assert lo <= float((tokens[:, 0] == 0).float().mean()) <= hi
    assert chi_square(tokens[:, 0], p[0, 0]) < CHI2_LIMIT        # the hot p, exactly


def test_target_probs_is_what_sample_draws_from():
    g = torch.Generator().manual_seed(4)
    n, vocab = 256, 50
    logits = torch.randn(n, vocab, generator=g) * 2
    temps = torch.tensor([0.0, 0.7, 1.0, 1.5]).repeat(n // 4)
    b = make_batch(n, vocab, top_p=0.9, min_p=0.02, top_k=20, outputs=[[r % vocab] for r in range(n)],
                   seen=[[r % vocab, 3] for r in range(n)], freq=0.5, rep=1.2)
    b.temperature = temps
    p = target_probs(logits, b)
    assert torch.allclose(p.sum(-1), torch.ones(n))
    assert ((p > 0).sum(-1)[temps == 0] == 1).all()
    tok, _ = sample(logits, b)
    assert torch.equal(sample_probs(p, b.seeds, b.steps), tok)


# ---- determinism, ragged drafts, argument checks ------------------------------------------------

def mixed_case(n=12, k=3, vocab=24, seed=5):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(n, k, vocab, generator=g) * 2, -1)
    seeds, first = torch.randint(0, 2**40, (n,), generator=g), torch.randint(0, 50, (n,), generator=g)
    drafts = torch.stack([sample_probs(q[:, i], seeds, first + i) for i in range(k)], 1)
    greedy = torch.arange(n) % 3 == 0
    num = torch.arange(n) % (k + 1)
    drafts = torch.where(torch.arange(k)[None] < num[:, None], drafts, -1)    # padded, as an engine would
    return drafts, q, p, seeds, first, greedy, num


def test_same_seed_same_tokens_in_any_batch_composition():
    args = mixed_case()
    whole = verify(*args)
    n = args[0].shape[0]
    for rows in (torch.randperm(n, generator=torch.Generator().manual_seed(6)), torch.tensor([7]),
                 torch.tensor([11, 2, 5])):
        part = verify(*[a[rows] for a in args])
        assert torch.equal(part[0], whole[0][rows]) and torch.equal(part[1], whole[1][rows])


def test_rows_may_propose_fewer_tokens():
    drafts, q, p, seeds, first, greedy, num = mixed_case()
    tokens, emitted = verify(drafts, q, p, seeds, first, greedy, num)
    assert (emitted >= 1).all() and (emitted <= num + 1).all()
    assert ((tokens >= 0).sum(-1) == emitted).all()
    none = num == 0
    plain = torch.where(greedy, p[:, 0].argmax(-1), sample_probs(p[:, 0], seeds, first))
    assert torch.equal(tokens[none, 0], plain[none])          # no draft: an ordinary sampling step
    k0 = verify(drafts[:, :0], q[:, :0], p[:, :1], seeds, first, greedy)
    assert torch.equal(k0[0][:, 0], plain) and (k0[1] == 1).all()


@pytest.mark.parametrize("name, change", [
    ("draft_tokens", lambda a: (a[0][:, :, None],) + a[1:]),
    ("draft_tokens", lambda a: (a[0].float(),) + a[1:]),
    ("draft_probs", lambda a: (a[0], a[1][:, :2]) + a[2:]),
    ("draft_probs", lambda a: (a[0], a[1][..., :5]) + a[2:]),
    ("target_probs", lambda a: a[:2] + (a[2][:, :3],) + a[3:]),
    ("target_probs", lambda a: a[:2] + (a[2][0],) + a[3:]),
    ("seeds", lambda a: a[:3] + (a[3][:5],) + a[4:]),
    ("first_step", lambda a: a[:4] + (a[4][:, None],) + a[5:]),
    ("greedy", lambda a: a[:5] + (a[5][1:],) + a[6:]),
    ("num_draft", lambda a: a[:6] + (a[6][:3],)),
])
def test_bad_shapes_name_the_argument(name, change):
    with pytest.raises(ValueError, match=name):
        verify(*change(mixed_case()))


def test_target_probs_checks_its_inputs():
    b = make_batch(4, 10, outputs=[[1]] * 4)
    with pytest.raises(ValueError, match="logits"):
        target_probs(torch.randn(10), b)
    with pytest.raises(ValueError, match="logits"):
        target_probs(torch.randn(3, 2, 10), b)
    with pytest.raises(ValueError, match="draft_tokens"):
        target_probs(torch.randn(4, 3, 10), b)                    # penalties need the context
    assert target_probs(torch.randn(4, 3, 10), b, torch.zeros(4, 2, dtype=torch.long)).shape == (4, 3, 10)
