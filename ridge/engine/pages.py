"""The page allocator of the paged KV cache: one pool of `num_pages` pages of `page_size` token
slots, allocated once; a sequence's page table maps its logical pages to physical ones. Pages are
reference counted:
  - prefix caching: a full page is named by a hash chained from its parent page's hash and its
    own tokens; a later request whose prompt starts with the same tokens takes the same pages;
  - forked samples (n > 1) share the prompt's pages; a shared page about to be written is copied
    first (copy-on-write), the copy queued for the runner to perform on the device.
A page whose count drops to zero goes to the back of the free queue but keeps its hash, so it can
still be hit until it is reused (least recently freed is reused first). With `events` on, a page
named in the prefix cache and a cached page reused are recorded for take_events (the KV events a
router reads, ridge/engine/kv_events.py)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ridge.engine.request import Sequence


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool, events: bool = False):
        self.num_pages, self.page_size, self.enable_prefix_caching = num_pages, page_size, enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_pages))
        self.cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # an EAGLE-3 head's cached entry at a page's last position was computed from the token after
        # it: only a hit that the next page also matched can be trusted, so the last hit is dropped
        # and recomputed (the target's states for it then reach the head); set by the proposer
        self.recompute_last_hit = False
        self.events: list[tuple] | None = [] if events else None
        # prompt tokens looked up in the prefix cache at admission, and of those found there (vLLM's
        # prefix_cache_queries / prefix_cache_hits): what a prefix-aware router is judged by
        self.prefix_query_tokens = self.prefix_hit_tokens = 0

    num_free_pages = property(lambda self: len(self.free_queue))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages holding the sequence's leading full pages. At least one token is left
        to compute, since its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.page_size):
            parent = chain_hash(parent, seq.token_ids[i * self.page_size:(i + 1) * self.page_size])
            page = self.cached.get(parent)
            if page is None:
                break
            hits.append(page)
        return hits[:-1] if self.recompute_last_hit else hits

    def register_full_pages(self, seq: Sequence) -> None:
        """Hash the pages that became full with this step's tokens and offer them to others."""
        full = seq.num_computed_tokens // self.page_size
        while len(seq.page_hashes) < full:
            i = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            h = chain_hash(parent, seq.token_ids[i * self.page_size:(i + 1) * self.page_size])
            seq.page_hashes.append(h)
            page = seq.page_table[i]
            if self.enable_prefix_caching and h not in self.cached and self.page_hash[page] is None:
                self.cached[h] = page
                self.page_hash[page] = h
                if self.events is not None:
                    self.events.append(("stored", h, parent, seq.token_ids[i * self.page_size:(i + 1) * self.page_size]))

    def pages_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> int:
        """Fresh pages to hold `num_new_tokens` more tokens: new pages, copies of shared pages
        that will be written, and cached hits that must come out of the free queue."""
        table = seq.page_table or list(hits)
        start = seq.num_computed_tokens or len(hits) * self.page_size
        end = start + num_new_tokens
        needed = max(0, self.pages_for(end) - len(table))
        needed += sum(self.ref_counts[table[i]] > 1 for i in range(start // self.page_size,
                                                                   min(len(table), self.pages_for(end))))
        if not seq.page_table:
            needed += sum(1 for b in hits if self.ref_counts[b] == 0)
        return needed

    def take_hits(self, seq: Sequence, hits: list[int], looked_up: bool = True) -> None:
        """`seq` admitted with `hits` (from match_prefix, when `looked_up`) as its leading pages."""
        assert not seq.page_table
        if looked_up and self.enable_prefix_caching:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(hits) * self.page_size
        for b in hits:
            self._ref(b)
        seq.page_table, seq.page_hashes = list(hits), [self.page_hash[b] for b in hits]
        seq.num_computed_tokens = len(hits) * self.page_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make pages for tokens [num_computed, num_computed + num_new_tokens) exist and be
        private to `seq`. The caller has checked pages_needed() <= num_free_pages."""
        end = seq.num_computed_tokens + num_new_tokens
        for i in range(seq.num_computed_tokens // self.page_size, min(len(seq.page_table), self.pages_for(end))):
            old = seq.page_table[i]
            if self.ref_counts[old] > 1:                   # copy-on-write
                new = self._pop_free()
                self.pending_copies.append((old, new))
                self._unref(old)
                seq.page_table[i] = new
        while len(seq.page_table) < self.pages_for(end):
            seq.page_table.append(self._pop_free())

    def reserve(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]] | None:
        """Make pages for positions [start, end) exist and be private to `seq`, like allocate but
        from `start` (which may lie before num_computed_tokens), for a draft head writing its own
        entries on the target's page numbers. Returns the copy-on-write copies, which the caller
        performs at once on every pool that mirrors these pages, or None (nothing changed) when
        the pool has too few free pages."""
        table, last = seq.page_table, self.pages_for(end)
        shared = [i for i in range(start // self.page_size, min(len(table), last)) if self.ref_counts[table[i]] > 1]
        if len(shared) + max(0, last - len(table)) > self.num_free_pages:
            return None
        copies = []
        for i in shared:
            new = self._pop_free()
            copies.append((table[i], new))
            self._unref(table[i])
            table[i] = new
        while len(table) < last:
            table.append(self._pop_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for b in parent.page_table:
            self._ref(b)
        child.page_table, child.page_hashes = list(parent.page_table), list(parent.page_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        # Tail pages first into the queue, so a sequence's prefix outlives its tail in the cache.
        for b in reversed(seq.page_table):
            self._unref(b)
        seq.page_table, seq.page_hashes, seq.num_computed_tokens = [], [], 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Return the pages past the first pages_for(num_tokens) of seq's table (tail first)."""
        keep = self.pages_for(num_tokens)
        for b in reversed(seq.page_table[keep:]):
            self._unref(b)
        del seq.page_table[keep:]

    def take_events(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _pop_free(self) -> int:
        page, _ = self.free_queue.popitem(last=False)
        h = self.page_hash[page]
        if h is not None and self.cached.get(h) == page:    # evict from the prefix cache
            del self.cached[h]
            if self.events is not None:
                self.events.append(("removed", h))
        self.page_hash[page], self.ref_counts[page] = None, 1
        return page

    def _ref(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_queue[page]
        self.ref_counts[page] += 1

    def _unref(self, page: int) -> None:
        if self.ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} freed more often than it was taken")
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_queue[page] = None
