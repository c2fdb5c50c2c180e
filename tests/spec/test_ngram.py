"""N-gram prompt lookup: what it proposes, which match it prefers, its bounds and its arguments."""
import random

import pytest

from types import SimpleNamespace

from ridge.engine.spec.ngram import NgramProposer, propose_ngram


def slow_reference(ids, min_n, max_n, k):
    """The definition, literally: longest n first, then the latest earlier start."""
    for n in range(max_n, min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if n <= len(ids) - 1 and ids[start:start + n] == ids[len(ids) - n:]:
                return ids[start + n:start + n + k]
    return []


def test_proposes_what_followed_the_match():
    ids = [10, 11, 12, 13, 14, 15, 99, 11, 12]
    assert propose_ngram(ids, 1, 3, 3) == [13, 14, 15]
    seq = SimpleNamespace(token_ids=ids)
    assert NgramProposer(1, 3, 2).propose([seq, seq], [5, 1]).tokens == [[13, 14], [13]]


def test_prefers_the_most_recent_occurrence():
    ids = [5, 6, 1, 9, 5, 6, 2, 9, 5, 6]
    assert propose_ngram(ids, 2, 2, 2) == [2, 9]


def test_prefers_the_longest_n_over_recency():
    # "6" alone last occurs before 3; the 3-gram "4 5 6" only before 7
    ids = [4, 5, 6, 7, 8, 0, 6, 3, 1, 4, 5, 6]
    assert propose_ngram(ids, 1, 3, 2) == [7, 8]
    assert propose_ngram(ids, 1, 1, 2) == [3, 1]               # capped at n = 1: the latest "6" wins
    assert propose_ngram(ids, 1, 2, 2) == [7, 8]               # "5 6" also occurs only before 7


def test_no_match_gives_nothing():
    assert propose_ngram([1, 2, 3, 4], 1, 3, 5) == []
    assert propose_ngram([], 1, 3, 5) == []
    assert propose_ngram([7], 1, 3, 5) == []                  # the suffix is not its own match
    assert propose_ngram([1, 2, 3, 1, 2], 3, 4, 5) == []       # only a 2-gram repeats
    assert NgramProposer(2, 4, 3).propose([SimpleNamespace(token_ids=[9, 8, 7, 6])], [3]).tokens == [[]]


def test_proposals_never_exceed_k_or_run_past_the_end():
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(ids, 1, 2, 100) == [3, 4, 5, 6, 1, 2]
    assert propose_ngram(ids, 1, 2, 3) == [3, 4, 5]
    assert propose_ngram([3, 3, 3], 1, 3, 5) == [3]            # overlapping match right before the end
    seq = SimpleNamespace(token_ids=ids)
    assert NgramProposer(1, 2, 4).propose([seq, seq], [2, 0]).tokens == [[3, 4], []]


def test_ignores_byte_matches_that_straddle_tokens():
    # packed little-endian, the bytes of 1 (01 00 00 00) also appear across 0x01000000 | 0
    ids = [1, 0x01000000, 0, 5, 1]
    assert propose_ngram(ids, 1, 1, 3) == [0x01000000, 0, 5]
    assert propose_ngram([0x01000000, 0, 5, 1], 1, 1, 3) == []


def test_agrees_with_the_definition_on_random_sequences():
    rng = random.Random(0)
    for trial in range(600):
        alphabet = rng.choice([2, 3, 5, 50, 70000])
        ids = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 4)
        hi, k = lo + rng.randrange(0, 4), rng.randrange(1, 6)
        assert propose_ngram(ids, lo, hi, k) == slow_reference(ids, lo, hi, k), (ids, lo, hi, k)


def test_accepts_tuples_and_is_fast_on_long_sequences():
    import time
    ids = tuple(random.Random(1).randrange(32000) for _ in range(32768)) + (1, 2, 3)
    t0 = time.perf_counter()
    for _ in range(10):
        propose_ngram(ids, 2, 4, 5)
    assert (time.perf_counter() - t0) / 10 < 0.05              # generous: CI machines vary


@pytest.mark.parametrize("args, name", [
    ((0, 3, 4), "prompt_lookup_min"),
    ((2, 1, 4), "prompt_lookup_max"),
    ((1, 3, 0), "num_speculative_tokens"),
    ((1, 3, -2), "num_speculative_tokens"),
    ((1.5, 3, 4), "prompt_lookup_min"),
    ((1, True, 4), "prompt_lookup_max"),
])
def test_bad_arguments_name_the_field(args, name):
    with pytest.raises(ValueError, match=name):
        NgramProposer(*args)
