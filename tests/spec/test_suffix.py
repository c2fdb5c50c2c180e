"""Suffix decoding's proposer (ridge/engine/spec/suffix.py): the longest match, the most frequent
continuation, the path-probability and match-length limits, the cache of finished outputs and its
bounds, and the configuration keys. The engine's greedy identity and sampled distribution with it
are in tests/spec/test_speculative.py."""
import random
from types import SimpleNamespace

import pytest

from ridge.config import SpeculativeConfig
from ridge.engine.request import SeqStatus
from ridge.engine.spec.suffix import SEPARATOR, SuffixProposer, TokenCorpus


def seq(ids, seq_id=0, prompt=None, status=SeqStatus.RUNNING, seed=None, temperature=0.0):
    request = SimpleNamespace(params=SimpleNamespace(seed=seed, temperature=temperature))
    return SimpleNamespace(seq_id=seq_id, token_ids=list(ids), status=status, request=request,
                           num_prompt_tokens=len(ids) if prompt is None else prompt)


def proposer(**kw):
    return SuffixProposer(**kw)


def test_continues_the_longest_match():
    # "1 2 3 4" is followed by 5 6 7 once and, further back a token, "9 2 3 4" by 8 8 8: the end
    # "0 1 2 3 4" matches the first occurrence 4 tokens back plus "1": that one wins though older
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 8, 8, 8, 0, 1, 2, 3, 4]
    assert proposer().draft(seq(ids), 3) == [5, 6, 7]


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    ids = [1, 2, 7, 1, 2, 7, 1, 2, 9, 1, 2]
    assert proposer().draft(seq(ids), 1) == [7]                 # 7 after "1 2" twice, 9 once
    assert proposer().draft(seq([1, 2, 7, 1, 2, 9, 1, 2]), 1) == [9]       # one each: the latest


def test_path_probability_and_match_length_bound_the_draft():
    ids = [5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 5, 6]
    # after "5 6": "1" twice (p = 1), then "2" (1), "3" (1), then "4" or "9" (p = 0.5)
    assert proposer(min_token_prob=0.6).draft(seq(ids), 8) == [1, 2]       # the match "5 6" is 2 long
    assert proposer(min_token_prob=0.6, max_spec_factor=3.0).draft(seq(ids), 8) == [1, 2, 3]
    assert proposer(min_token_prob=0.4, max_spec_factor=3.0).draft(seq(ids), 8) == [1, 2, 3, 9, 5, 6]
    assert proposer(max_spec_factor=3.0).draft(seq(ids), 2) == [1, 2]      # the step's limit
    assert proposer(max_spec_factor=0.4).draft(seq(ids), 8) == []          # 0.4 x 2 tokens: none


def test_no_match_and_short_sequences_give_nothing():
    assert proposer().draft(seq([1, 2, 3, 4, 5]), 4) == []
    assert proposer().draft(seq([]), 4) == [] and proposer().draft(seq([3]), 4) == []
    assert proposer().draft(seq([3, 4]), 4) == []               # the end is not its own match
    assert proposer().draft(seq([3, 3]), 4) == [3]              # one token matched: one drafted
    assert proposer().draft(seq([3, 3, 3]), 4) == [3]           # an overlapping match: up to the end


def test_the_corpus_follows_a_growing_sequence():
    p = proposer()
    s = seq([1, 2, 3, 4, 9])
    assert p.draft(s, 4) == []
    s.token_ids += [1, 2]
    assert p.draft(s, 4) == [3, 4]
    assert len(p.corpora[0]) == 7


def test_finished_outputs_are_cached_and_the_longer_match_wins():
    p = proposer()
    done = seq([50, 51, 52] + [1, 2, 3, 4, 5, 6], seq_id=1, prompt=3)
    p.draft(done, 4)
    done.status = SeqStatus.FINISHED
    p.release({1})
    assert 1 not in p.corpora and list(p.cache.tokens) == [1, 2, 3, 4, 5, 6, SEPARATOR]
    assert p.draft(seq([9, 9, 1, 2, 3], seq_id=2), 3) == [4, 5, 6]          # from the cache
    # the sequence's own "2 3" is followed by 7, but the cache matches "1 2 3": 3 tokens beat 2
    assert p.draft(seq([2, 3, 7, 1, 2, 3], seq_id=3), 2) == [4, 5]
    assert p.draft(seq([8, 1, 2, 3, 7, 8, 1, 2, 3], seq_id=4), 1) == [7]    # its own: 4 tokens back
    # a seeded request that samples looks in its own tokens only (its output must not depend on others)
    assert p.draft(seq([9, 9, 1, 2, 3], seq_id=5, seed=1, temperature=0.7), 3) == []
    assert p.draft(seq([9, 9, 1, 2, 3], seq_id=6, seed=1, temperature=0.0), 3) == [4, 5, 6]


def test_preempted_sequences_are_not_cached_and_the_cache_can_be_off():
    p = proposer()
    p.draft(seq([1, 2, 3, 4], seq_id=5, prompt=1), 2)
    p.release({5})                                          # still running: preempted, not done
    assert len(p.cache) == 0 and not p.corpora
    off = proposer(max_cached_requests=0)
    off.draft(seq([1, 2, 3, 4], seq_id=6, prompt=1, status=SeqStatus.FINISHED), 2)
    off.release({6})
    assert len(off.cache) == 0


def test_the_cache_keeps_the_newest_requests():
    p = proposer(max_cached_requests=4)
    for i in range(9):
        p.draft(seq([100 + i, 100 + i, 100 + i], seq_id=i, prompt=1, status=SeqStatus.FINISHED), 1)
        p.release({i})
    assert 2 <= len(p.cached) <= 4 and p.cached[-1] == [108, 108]
    assert set(p.cache.tokens) == {t for out in p.cached for t in out} | {SEPARATOR}


def test_agrees_with_a_brute_force_longest_match():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        c = TokenCorpus()
        c.extend(ids)
        length, at = c.match(ids, 24)
        n, best, want = len(ids), 0, []
        for p in range(1, n):                               # an occurrence ending right before p
            L = 0
            while L < min(24, p) and ids[p - 1 - L] == ids[n - 1 - L]:
                L += 1
            if L >= 1 and L > best:
                best, want = L, [p]
            elif L >= 1 and L == best:
                want.append(p)
        want.sort(reverse=True)                             # most recent first; fewer than 64 here
        assert (length, at) == (best, want), (ids, length, at)


@pytest.mark.parametrize("key, value, message", [
    ("suffix_decoding_max_tree_depth", 0, "integer >= 1"),
    ("suffix_decoding_max_tree_depth", 2.5, "integer >= 1"),
    ("suffix_decoding_max_spec_factor", 0, "number > 0"),
    ("suffix_decoding_max_spec_factor", True, "number > 0"),
    ("suffix_decoding_min_token_prob", 1.5, r"\[0, 1\]"),
    ("suffix_decoding_max_cached_requests", -1, "integer >= 0"),
])
def test_bad_keys_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=f"{key} must be an? .*{message}"):
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8, key: value})


def test_suffix_keys_need_the_suffix_method():
    with pytest.raises(ValueError, match="only method 'suffix'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.2})
    spec = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 16,
                                    "suffix_decoding_max_spec_factor": 2, "suffix_decoding_max_cached_requests": 0})
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_max_cached_requests) == (24, 2, 0)


def test_agent_benchmark_builds_turns_of_edits_and_compares_the_methods():
    """benchmarks/engine/spec_decode.py agent, tiny: each file's turns differ by one more edit, in
    the second half; every method gives plain decoding's greedy tokens and suffix decoding drafts."""
    from ridge.assets import demo_model_path
    from tests.tests_support import load_benchmark
    bench = load_benchmark("spec_decode")
    turns = bench.agent_prompts(demo_model_path(), 1, 3, 64)
    assert len(turns) == 3 and all(len(t) == 64 for t in turns) and turns[0][:32] == turns[2][:32]
    edits = [sum(a != b for a, b in zip(turns[0], t)) for t in turns]      # an edit may copy an equal token
    assert edits[0] == 0 and edits[1] <= 1 and 0 < edits[2] <= 2
    out = bench.run_agent(bench.parse_args(["agent", "--prompts", "1", "--turns", "2", "--prompt-len", "64",
                                            "--output-len", "12"]))
    rows = {r["method"]: r for r in out["rows"]}
    assert list(rows) == ["plain", "suffix", "ngram"] and all(r["same_tokens_as_plain"] for r in rows.values())
    assert rows["suffix"]["drafts"] > 0 and rows["plain"]["speedup"] == 1
