"""Suffix decoding: drafts from the longest match of a sequence's end in its own tokens and in the
outputs of earlier requests, continued by frequency (vLLM's `"method": "suffix"`; SuffixDecoding,
Oliaro et al., arXiv 2411.04975).

Agent loops, code edits and RL rollouts repeat themselves: tool outputs come back verbatim, a file is
rewritten with small changes, the same plan is restated. N-gram lookup (ngram.py) guesses from the
most recent occurrence of a fixed-length n-gram in the prompt; suffix decoding differs in three
ways, each a better guess on such traffic:
  * the match is as long as it can be (up to `max_depth` tokens), so a long shared context picks
    the one place that is really being repeated;
  * among the places that match equally far back, the next token is the most frequent one that
    followed them, and the draft goes on token by token while that frequency, multiplied along the
    path, stays above `min_token_prob`: a confident continuation runs long, a contested one stops;
  * the draft's length is at most `max_spec_factor` x the match length, so a short, chance match
    drafts little, and finished requests' outputs (up to `max_cached_requests`, then the oldest
    go) are searched too, not only the sequence itself. The longer match wins; at equal length the
    sequence's own.
Drafts are point masses: the target's rejection sampling (rejection.py) keeps the output exactly
the target's.

Each token corpus (one a running sequence, built from its prompt at its first proposal and then
extended by its new tokens; one for the cached outputs) keeps an index from every 1-, 2- and
4-token window to the positions just after it, so a lookup reads a few dozen candidates (the most
recent ones) instead of scanning the corpus. A candidate's match length is counted backwards from
the window, at most `max_depth` tokens.

A seeded request that samples drafts from its own tokens only: its drafts, and so the random draws
of its verification, then do not depend on what other requests ran before it, and it gives the
same tokens alone or in any batch (as ridge promises of seeded sampling).
"""
from __future__ import annotations

from array import array
from collections import Counter, deque

from ridge.engine.request import SeqStatus
from ridge.engine.spec.proposer import Proposal

WINDOWS = (4, 2, 1)         # the window lengths a lookup tries, longest first
CANDIDATES = 64             # the most recent positions a lookup reads for each window
SEPARATOR = -1              # ends each cached output: no window or continuation crosses it
MAX_CACHED_TOKENS = 1 << 20  # the cached outputs' corpus is cut to its newer half past this


class TokenCorpus:
    """Token ids, and for each 1-, 2- and 4-token window the positions that follow it, oldest first."""

    def __init__(self):
        self.tokens = array("i")
        self.index: dict[tuple[int, ...], array] = {}     # window -> the positions after it

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, ids) -> None:
        t, start = self.tokens, len(self.tokens)
        t.extend(ids)
        index = self.index
        for w in WINDOWS:
            first = max(start, w - 1)                       # the last token of the first new window
            columns = [t[first - w + 1 + i:len(t) - w + 1 + i] for i in range(w)]
            for after, key in enumerate(zip(*columns), first + 1):
                if SEPARATOR not in key:
                    found = index.get(key)
                    if found is None:
                        index[key] = array("i", (after,))
                    else:
                        found.append(after)

    def match(self, query, max_depth: int) -> tuple[int, list[int]]:
        """(L, positions): the longest L <= max_depth for which query's last L tokens occur here
        followed by a token, and the positions right after those occurrences, most recent first;
        (0, []) when not even the last token does."""
        t, n = self.tokens, len(query)
        for w in WINDOWS:
            if n < w or w > max_depth:
                continue
            found = self.index.get(tuple(query[n - w:]))
            if not found:
                continue
            best, at = 0, []
            for p in reversed(found[-CANDIDATES:]):
                if p >= len(t) or t[p] == SEPARATOR:
                    continue                                # nothing follows this occurrence
                length = w
                while length < max_depth and length < n and p - length - 1 >= 0 and \
                        t[p - length - 1] == query[n - length - 1]:
                    length += 1
                if length > best:
                    best, at = length, [p]
                elif length == best:
                    at.append(p)
            if at:
                return best, at
        return 0, []

    def continue_from(self, positions: list[int], most: int, min_prob: float) -> list[int]:
        """Up to `most` tokens: at each step the most frequent token after the positions still in
        play (the most recent on a tie), while the product of those frequencies is >= min_prob."""
        t, out, prob = self.tokens, [], 1.0
        while len(out) < most:
            if len(positions) == 1:                             # one path left: its tokens, frequency 1
                run = t[positions[0]:positions[0] + most - len(out)].tolist()
                out += run[:run.index(SEPARATOR)] if SEPARATOR in run else run
                break
            nexts = [t[p] for p in positions if p < len(t) and t[p] != SEPARATOR]
            if not nexts:
                break
            token = nexts[0]
            if nexts.count(token) != len(nexts):                # the paths part: the most frequent
                token, count = Counter(nexts).most_common(1)[0]  # ties: the first seen, the most recent
                prob *= count / len(nexts)
            if prob < min_prob:
                break
            out.append(token)
            positions = [p + 1 for p in positions if p < len(t) and t[p] == token]
        return out


class SuffixProposer:
    """The configured proposer: vLLM's suffix_decoding_max_tree_depth / _max_spec_factor /
    _min_token_prob / _max_cached_requests (0: no cache of earlier outputs). The most drafts a step
    (num_speculative_tokens) is the speculator's limit for each sequence."""
    masks_grammar = True     # point masses

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 10000):
        self.max_depth, self.factor, self.min_prob = max_depth, max_spec_factor, min_token_prob
        self.max_cached = max_cached_requests
        self.corpora: dict[int, TokenCorpus] = {}          # seq_id -> its own tokens
        self.seqs: dict[int, object] = {}                  # seq_id -> the sequence (to see it finish)
        self.cache = TokenCorpus()                         # finished requests' outputs, each then SEPARATOR
        self.cached: deque[list[int]] = deque()            # those outputs, oldest first

    def _own(self, seq) -> TokenCorpus:
        corpus = self.corpora.get(seq.seq_id)
        if corpus is None:
            corpus = self.corpora[seq.seq_id] = TokenCorpus()
            self.seqs[seq.seq_id] = seq
        if len(corpus) < len(seq.token_ids):
            corpus.extend(seq.token_ids[len(corpus):])
        return corpus

    def draft(self, seq, limit: int) -> list[int]:
        """At most `limit` tokens continuing the sequence: from its own tokens or the cached outputs,
        whichever matches its end further back."""
        query = seq.token_ids
        own = self._own(seq)
        p = seq.request.params
        private = p.seed is not None and p.temperature > 0
        best, source, positions = 0, None, []
        for corpus in (own,) if private else (own, self.cache):
            length, at = corpus.match(query, self.max_depth)
            if length > best:
                best, source, positions = length, corpus, at
        if source is None:
            return []
        most = min(limit, int(self.factor * best))
        return source.continue_from(positions, most, self.min_prob) if most > 0 else []

    def propose(self, seqs: list, limits: list[int]) -> Proposal:
        return Proposal([self.draft(s, lim) for s, lim in zip(seqs, limits)])

    def release(self, seq_ids: set[int]) -> None:
        """Drop the sequences' corpora; a finished one's output joins the cache of earlier outputs
        (a preempted one is proposed for again later, from its tokens then)."""
        for i in seq_ids:
            self.corpora.pop(i, None)
            seq = self.seqs.pop(i, None)
            if seq is not None and seq.status == SeqStatus.FINISHED and self.max_cached > 0:
                self._remember(list(seq.token_ids[seq.num_prompt_tokens:]))

    def _remember(self, output: list[int]) -> None:
        if len(output) < 2:
            return
        self.cached.append(output)
        self.cache.extend(output + [SEPARATOR])
        if len(self.cached) > self.max_cached or len(self.cache) > MAX_CACHED_TOKENS:
            size = len(self.cache)                          # the corpus: each output and its separator
            while len(self.cached) > max(1, self.max_cached // 2) or size > MAX_CACHED_TOKENS // 2:
                size -= len(self.cached.popleft()) + 1      # the older half goes; the rest is re-indexed
            self.cache = TokenCorpus()
            for out in self.cached:
                self.cache.extend(out + [SEPARATOR])
