"""One ridge engine per Ray Serve replica.

The replica runs ridge's own front end, EngineClient (the engine in a thread of the replica's
process, continuous batching across every request the replica holds), and exposes it to the
ingress as a streaming method: `generate` yields ACCEPTED once the engine has queued the request
(or the refusal, as a value: a ValueError names the parameter for a 400), then each EngineItem
as the engine produces it, up to the finished output or the error that ended the request. A
response the caller cancels (its client left) aborts the request, which frees its pages.

Ray Serve polls `record_routing_stats` (the engine's EngineStats, which the ingress sums for
/metrics and shows per replica) and `check_health` (a dead engine gets the replica replaced).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools

from ridge.config import EngineConfig
from ridge.engine.prompts import TokenizedPrompt
from ridge.engine.sampling_params import SamplingParams
from ridge.server.cli import load_engine
from ridge.server.engine_client import LOADING, EngineClient, EngineFailure, EngineUnavailable, ModelInfo

ACCEPTED = "accepted"


class EngineReplica:
    async def __init__(self, engine: dict, tokenizer_pool_size: int = 2):
        """`engine`: EngineConfig's settings. The replica is ready (Ray Serve routes to it) once
        the model has loaded; a load that fails fails the replica's start."""
        cfg = EngineConfig.from_kwargs(**engine)
        self.client = EngineClient(functools.partial(load_engine, cfg), tokenizer_workers=tokenizer_pool_size)
        self.client.start()
        while self.client.state == LOADING:
            await asyncio.sleep(0.05)
        self.client.check_ready()

    async def generate(self, request_id: str, prompt: TokenizedPrompt | list[int], params: SamplingParams):
        sink: asyncio.Queue = asyncio.Queue()
        try:
            await self.client.add(request_id, prompt, params, sink)
        except (ValueError, EngineUnavailable, EngineFailure) as e:
            yield e
            return
        yield ACCEPTED
        done = False
        try:
            while not done:
                item = await sink.get()
                done = item.error is not None or item.output.finished
                yield item
        finally:
            if not done:            # the caller cancelled: its client left, or the ingress aborted
                self.client.abort(request_id)

    def model_info(self) -> ModelInfo:
        return self.client.model

    def record_routing_stats(self) -> dict:
        stats = self.client.stats
        return {} if stats is None else {"engine": dataclasses.asdict(stats)}

    def check_health(self) -> None:
        self.client.check_ready()

    def __del__(self):
        if hasattr(self, "client"):     # not when the constructor failed
            self.client.stop()
