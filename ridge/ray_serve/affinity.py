"""Which replica a request goes to: the one that last took the longest run of its leading pages,
unless that replica is much busier than the least loaded one; otherwise the least loaded.

A prompt's leading full pages are named exactly as ridge's prefix cache names them
(ridge.engine.pages.chain_hash, page by page, each page's name covering everything before it),
so "the replica that last took this page chain" is the replica whose prefix cache most likely
still holds it: a hit there skips the prefill of those pages. The table of page names is an LRU
of bounded size; a prompt's pages refresh their entries each time it is routed. The policy knows
nothing of Ray (ridge.ray_serve.router plugs it into Ray Serve's request router), so it is tested
on its own.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from ridge.engine.pages import chain_hash


def page_chain(token_ids: list[int], page_size: int) -> list[bytes]:
    """The names of the prompt's leading full pages, as the prefix cache hashes them."""
    names, parent = [], None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = chain_hash(parent, token_ids[start:start + page_size])
        names.append(parent)
    return names


class PrefixAffinity:
    """`choose` a replica for a prompt given each candidate's load (requests in flight), and
    `record` where a prompt went. `imbalance`: how many more requests than the least loaded
    replica the prefix's replica may hold and still be chosen; `capacity`: page names kept."""

    def __init__(self, page_size: int, imbalance: int = 8, capacity: int = 1 << 16):
        if page_size < 1 or imbalance < 0 or capacity < 1:
            raise ValueError(f"page_size >= 1, imbalance >= 0 and capacity >= 1 required, got {page_size}, "
                             f"{imbalance}, {capacity}")
        self.page_size, self.imbalance, self.capacity = page_size, imbalance, capacity
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()
        self._turn = 0

    def choose(self, token_ids: list[int] | None, loads: dict[Hashable, int]) -> Hashable:
        """The replica (a key of `loads`) for a prompt; None token ids: the least loaded."""
        if not loads:
            raise ValueError("loads: no replica to choose from")
        low = min(loads.values())
        owner = self.owner(token_ids, loads) if token_ids else None
        if owner is not None and loads[owner] - low <= self.imbalance:
            return owner
        # ties (idle replicas, most often) take turns: new prefixes spread instead of piling on one
        least = [r for r, load in loads.items() if load == low]
        self._turn += 1
        return least[self._turn % len(least)]

    def owner(self, token_ids: list[int], candidates) -> Hashable | None:
        """The candidate that last took the longest run of these leading pages, if any."""
        found = None
        for name in page_chain(token_ids, self.page_size):
            replica = self._owner.get(name)
            if replica is None:
                break
            if replica in candidates:
                found = replica
        return found

    def record(self, token_ids: list[int] | None, replica: Hashable) -> None:
        """`replica` took this prompt: its pages are now (most likely) cached there."""
        for name in page_chain(token_ids or [], self.page_size):
            self._owner[name] = replica
            self._owner.move_to_end(name)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: its pages went with it."""
        for name in [n for n, r in self._owner.items() if r == replica]:
            del self._owner[name]

    def __len__(self) -> int:
        return len(self._owner)
