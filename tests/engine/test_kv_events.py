"""KV-cache events in vLLM's format (ridge/engine/kv_events.py): a subscriber that decodes them with
the message types vLLM's own example subscriber declares sees every page the prefix cache named
(its hash the chain of its tokens, its parent the page before) and every cached page reused, in
order, numbered without gaps; what it was told stored and not removed is what the cache holds."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.pages import chain_hash


# the message types, as a vLLM subscriber declares them (msgspec: arrays, tagged by class name)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def receive(sub) -> list[tuple[int, KVEventBatch]]:
    decode, got = msgspec.msgpack.Decoder(type=KVEventBatch).decode, []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), decode(payload)))
    return got


@pytest.fixture
def subscribed():
    """An LLM whose pool holds 20 pages (98,304 bytes each; prompts of ~6 pages evict each other) publishing on an
    ephemeral port, and a subscriber connected to it."""
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    with LLM(demo_model_path(), device="cpu", show_progress=False, page_size=16, max_num_seqs=2,
             kv_cache_memory=20 * 98304, kv_events_config=cfg) as llm:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(llm.engine.kv_events.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)                     # the subscription reaches the publisher (ZMQ's slow joiner)
        yield llm, sub
        sub.close(0)
        ctx.term()


def test_a_subscriber_sees_every_page_stored_and_removed(subscribed):
    llm, sub = subscribed
    pages = llm.engine.pages
    assert pages.num_pages == 20
    prompts = [f"# file {i}\n" + "def f(x):\n    return x + 1\n" * 8 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p in prompts + prompts[:2]:        # the last two come back: hits, or evicted and stored again
        llm.generate([p], params, use_tqdm=False)
    got = receive(sub)
    assert [seq for seq, _ in got] == list(range(got[0][0], got[0][0] + len(got)))     # no gap
    held: dict[bytes, list[int]] = {}
    removed = 0
    for _, batch in got:
        for e in batch.events:
            if isinstance(e, BlockStored):
                (h,) = e.block_hashes
                assert e.block_size == 16 and len(e.token_ids) == 16 and e.medium == "CPU" and e.lora_id is None
                assert chain_hash(e.parent_block_hash, e.token_ids) == h
                assert e.parent_block_hash is None or e.parent_block_hash in held   # a chain's pages in order
                assert h not in held
                held[h] = e.token_ids
            elif isinstance(e, BlockRemoved):
                (h,) = e.block_hashes
                assert held.pop(h, None) is not None
                removed += 1
    assert removed > 0                      # the pool was too small to keep every prompt's pages
    assert set(held) == set(pages.cached)   # what the router was told is what the cache holds


def test_a_bad_endpoint_is_refused_naming_it():
    with pytest.raises(ValueError, match="kv_events_config: cannot bind endpoint 'tcp://256.0.0.1:1'"):
        LLM(demo_model_path(), device="cpu", show_progress=False, kv_cache_memory=8 << 20,
            kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://256.0.0.1:1"})


def test_off_unless_enabled():
    with LLM(demo_model_path(), device="cpu", show_progress=False, kv_cache_memory=8 << 20,
             kv_events_config={"endpoint": "tcp://127.0.0.1:*"}) as llm:
        assert llm.engine.kv_events is None and llm.engine.pages.events is None
