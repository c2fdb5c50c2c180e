"""The prefix-aware router's choice on its own (ridge.ray_serve.affinity and the Ray Serve router
around it, with stand-in replicas): no Ray cluster, fast."""
import asyncio
from types import SimpleNamespace

import pytest

from ridge.engine.pages import PageAllocator
from ridge.engine.request import Request, Sequence
from ridge.engine.sampling_params import SamplingParams
from ridge.ray_serve.affinity import PrefixAffinity, page_chain

pytestmark = pytest.mark.ray

PAGE = 4
SHARED = list(range(100, 112))          # three full pages


def test_page_chain_names_pages_as_the_prefix_cache_does():
    """The router's page names are the cache's: a prompt the cache registered is found under them."""
    pages = PageAllocator(8, PAGE, enable_prefix_caching=True)
    seq = Sequence(0, Request("r", None, SHARED + [1], SamplingParams(), 8), 0, SHARED + [1], 13, seed=0)
    pages.allocate(seq, 13)
    seq.num_computed_tokens = 13
    pages.register_full_pages(seq)
    assert page_chain(SHARED + [1], PAGE) == [pages.page_hash[p] for p in seq.page_table[:3]]
    assert page_chain([1, 2, 3], PAGE) == []                            # no full page: nothing to match


def test_a_shared_prefix_goes_where_it_went_before():
    aff = PrefixAffinity(PAGE, imbalance=2)
    loads = {"a": 0, "b": 0}
    first = aff.choose(SHARED + [1], loads)
    aff.record(SHARED + [1], first)
    other = "b" if first == "a" else "a"
    assert aff.choose(SHARED + [2, 3], {first: 1, other: 0}) == first     # a little busier: still its prefix
    assert aff.choose(SHARED[:8] + [9] * 8, {first: 0, other: 0}) == first  # two of its pages match
    assert aff.choose(SHARED + [2], {first: 3, other: 0}) == other        # much busier: the least loaded


def test_the_longest_match_wins_and_the_rest_go_to_the_least_loaded():
    aff = PrefixAffinity(PAGE)
    aff.record(SHARED[:4] + [0] * 8, "a")          # one page in common with SHARED
    aff.record(SHARED + [7], "b")                   # all three
    assert aff.choose(SHARED + [5], {"a": 0, "b": 0}) == "b"
    assert aff.choose(SHARED[:4] + [0] * 4, {"a": 0, "b": 0}) == "a"
    assert aff.choose([9] * 12, {"a": 2, "b": 1}) == "b"       # no match: the least loaded
    assert aff.choose(None, {"a": 0, "b": 1}) == "a"


def test_ties_between_idle_replicas_rotate_so_distinct_prefixes_spread():
    aff = PrefixAffinity(PAGE)
    chosen = []
    for i in range(4):
        prompt = [1000 * (i + 1)] * 8
        chosen.append(aff.choose(prompt, {"a": 0, "b": 0}))
        aff.record(prompt, chosen[-1])
    assert sorted(chosen) == ["a", "a", "b", "b"]


def test_a_gone_replica_is_forgotten_and_the_table_is_bounded():
    aff = PrefixAffinity(PAGE, capacity=4)
    aff.record(SHARED, "a")
    assert aff.choose(SHARED + [1], {"b": 0, "c": 0}) in ("b", "c")   # "a" is not a candidate
    aff.forget("a")
    assert len(aff) == 0
    for i in range(3):
        aff.record([i] * 8, "b")                    # two pages each: six names into four places
    assert len(aff) == 4
    assert aff.owner([0] * 8, {"b"}) is None        # the least recently routed went first
    assert aff.owner([2] * 8, {"b"}) == "b"
    with pytest.raises(ValueError, match="page_size"):
        PrefixAffinity(0)
    with pytest.raises(ValueError, match="no replica"):
        aff.choose([1], {})


def _replica(name):
    from ray.serve.request_router import ReplicaID
    from ray.serve._private.common import DeploymentID
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("EngineReplica", "test")), max_ongoing_requests=8)


def _request(prompt, n=0, method="generate"):
    meta = SimpleNamespace(call_method=method, internal_request_id=f"req-{n}")
    return SimpleNamespace(args=[f"r{n}", prompt, None], kwargs={}, metadata=meta,
                           routing_context=SimpleNamespace(should_backoff=False))


def test_the_ray_router_ranks_the_prefix_replica_first_and_counts_what_it_has_in_flight():
    from ridge.ray_serve.router import PrefixAwareRouter
    from ridge.engine.prompts import TokenizedPrompt

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)      # Ray Serve's constructor wants a cluster
    router._deployment_id = SimpleNamespace(app_name="test", name="EngineReplica")
    router.initialize_state(page_size=PAGE, imbalance=1)
    a, b = _replica("a"), _replica("b")
    choose = lambda req: asyncio.run(router.choose_replicas([a, b], req))      # noqa: E731

    req = _request(TokenizedPrompt(None, SHARED + [1]), 0)
    ranks = choose(req)
    first = ranks[0][0]
    assert ranks[1] == [a, b] and req.routing_context.should_backoff
    router.on_request_routed(req, first.replica_id, None)
    other = b if first is a else a
    again = _request(SHARED + [2], 1)              # plain ids work too
    assert choose(again)[0] == [first]             # one in flight there: within the imbalance
    router.on_request_routed(again, first.replica_id, None)
    assert choose(_request(SHARED + [3], 2))[0] == [other]     # two more than the idle one: too busy
    router.on_request_completed(first.replica_id, "req-1")
    router.on_request_completed(first.replica_id, "req-1")     # reported twice: counted once
    assert router.in_flight[first.replica_id] == 1
    assert choose(_request(None, 3, method="model_info"))[0] == [other]   # no prompt: the least loaded

