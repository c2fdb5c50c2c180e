"""KV-cache events for a KV-aware router (`kv_events_config`): which pages the prefix cache holds,
published as vLLM publishes them, so the routers built for vLLM read ridge too (llm-d's precise
prefix-cache scorer, Dynamo's KV router, the inference gateway's KV-aware plug-ins).

A router that knows which prompt prefixes each replica holds can send a request where its prefix
is already computed: the prefill it skips is the expensive part of a long shared prompt. The
engine says so as it happens: a full page named in the prefix cache is BlockStored (its hash, its
parent's, its tokens), a cached page reused for other tokens is BlockRemoved, and a new engine
starts with AllBlocksCleared (whatever a subscriber knew of an earlier process is gone).

The wire format is vLLM's: a ZMQ PUB socket sends [topic, sequence number (8 bytes, big-endian),
payload] per engine step that had events, the payload a msgpack array [timestamp, [event, ...]],
each event an array [tag, fields...] (msgspec's array_like, tagged structs):
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
A page's hash is ridge's prefix-cache hash (32 bytes: SHA-256 chained over the page's tokens,
ridge/engine/pages.py); vLLM's subscribers take bytes or integers. Sending never blocks the engine:
past `hwm` queued messages a slow subscriber loses the newest, and sees the gap in the numbers.
"""
from __future__ import annotations

import time

from ridge.config import KVEventsConfig


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, block_size: int, medium: str):
        try:
            import msgspec
            import zmq
        except ImportError as e:
            raise ValueError(f"kv_events_config: publishing needs pyzmq and msgspec ({e.name} is not installed: "
                             "pip install pyzmq msgspec)") from None
        self.block_size, self.medium, self._zmq = block_size, medium, zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic, self._seq, self.dropped = cfg.topic.encode(), 0, 0
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(cfg.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"kv_events_config: cannot bind endpoint {cfg.endpoint!r}: {e}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._send([["AllBlocksCleared"]])

    def publish(self, page_events: list[tuple]) -> None:
        """One step's page events from PageAllocator.take_events(): ("stored", hash, parent, tokens)
        or ("removed", hash), in the order they happened."""
        if page_events:
            self._send([["BlockStored", [e[1]], e[2], e[3], self.block_size, None, self.medium] if e[0] == "stored"
                        else ["BlockRemoved", [e[1]], self.medium] for e in page_events])

    def _send(self, events: list) -> None:
        frames = [self._topic, self._seq.to_bytes(8, "big"), self._encode([time.time(), events])]
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:         # the subscribers' queues are full: this batch is theirs to miss
            self.dropped += 1
        self._seq += 1

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.close(linger=0)
            self._ctx.term()
