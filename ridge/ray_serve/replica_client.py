"""The OpenAI ingress's front end to the engine replicas: EngineClient's interface (the routes of
ridge.server use it unchanged), the engine behind a Ray Serve deployment handle.

The ingress tokenizes (the checkpoint's own encoder, in worker threads, as `ridge serve` does),
so the router sees each prompt's token ids and can send it where its leading pages are cached.
Each request is a streaming call, `generate`, to one replica; a pump task copies what comes back
into the route's queue as EngineItems. Abort cancels the call (the replica aborts the request).

A replica that dies: a request that had no output yet is sent again (Ray Serve's router has
dropped the dead replica by then, so it goes to another); one whose stream had started ends with
an error item, which the routes turn into an error event and [DONE]. No request ends silently.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from ridge.engine.engine import EngineStats
from ridge.engine.llm import load_tokenizer
from ridge.engine.prompts import PromptEncoder
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.token_text import TokenTexts
from ridge.ray_serve.replica import ACCEPTED
from ridge.ray_serve.routers import router_of
from ridge.server.engine_client import (LOADING, READY, STOPPED, EngineFailure, EngineItem, EngineUnavailable,
                                        ModelInfo, settle)
from ridge.server.prompt_work import ChatPrompt, encode_in_worker

log = logging.getLogger("ridge.server")

# a request with no output yet tries this many replicas before it fails; between tries the
# router learns of the dead replica (its actor's death reaches the handle)
ATTEMPTS = 3
RETRY_WAIT = 0.5


class ReplicaClient:
    """Made by `connect` (from the ingress's constructor, so that Ray Serve routes no request to
    the ingress before it can tokenize); serving from `start` (the app's lifespan) on."""

    def __init__(self, handle, model: ModelInfo, tokenizer, tokenizer_workers: int = 2):
        self.handle, self.model, self.tokenizer_workers = handle, model, tokenizer_workers
        self.state = LOADING
        self._encoder = PromptEncoder(tokenizer, model.max_model_len) if tokenizer is not None else None
        self._texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._loop = self._pool = None
        self._requests: dict[str, asyncio.Task] = {}

    @classmethod
    async def connect(cls, handle, tokenizer_workers: int = 2) -> "ReplicaClient":
        """`handle`: the EngineReplica deployment's; its model's checkpoint directory (where a
        replica loaded it) must be readable here too, for the tokenizer."""
        model = await handle.model_info.remote()
        return cls(handle, model, await asyncio.to_thread(load_tokenizer, model.path), tokenizer_workers)

    # -- lifetime ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self.tokenizer_workers, thread_name_prefix="ridge-tokenize")
        self.state = READY

    def stop(self, timeout: float = 30.0) -> None:
        self.state = STOPPED
        for task in list(self._requests.values()):
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def check_ready(self) -> None:
        if self.state != READY:
            raise EngineUnavailable(f"the ingress is not serving ({self.state})")

    # -- what the routes call ---------------------------------------------------------------------
    async def add(self, request_id: str, prompt, params: SamplingParams, sink: asyncio.Queue,
                  parse_special_tokens: bool = False) -> None:
        self.check_ready()
        if isinstance(prompt, (str, ChatPrompt)) and self._encoder is not None:
            prompt = await encode_in_worker(self._loop, self._pool, self._encoder, prompt, parse_special_tokens)
            self.check_ready()
        elif isinstance(prompt, ChatPrompt):
            raise ValueError("messages: this model has no tokenizer")
        accepted = self._loop.create_future()
        task = asyncio.ensure_future(self._forward(request_id, prompt, params, sink, accepted))
        self._requests[request_id] = task
        task.add_done_callback(lambda _: self._requests.pop(request_id, None))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        task = self._requests.pop(request_id, None)
        if task is not None:
            task.cancel()

    def token_texts(self, ids: list[int]) -> list[tuple[str | None, bytes | None]]:
        return [self._texts(t) if self._texts is not None else (None, None) for t in ids]

    async def run_in_worker(self, fn, *args):
        return await self._loop.run_in_executor(self._pool, fn, *args)

    # -- the replicas' stats ----------------------------------------------------------------------
    def replica_stats(self) -> dict[str, EngineStats]:
        """Each live replica's last reported EngineStats, by replica id."""
        router = router_of(self.handle.app_name, self.handle.deployment_name)
        if router is None:
            return {}
        return {rid.unique_id: EngineStats(**r.routing_stats["engine"])
                for rid, r in list(router.curr_replicas.items()) if "engine" in (r.routing_stats or {})}

    @property
    def stats(self) -> EngineStats | None:
        """The replicas' stats summed (KV-cache usage: pages held over pages, all replicas)."""
        return sum_stats(list(self.replica_stats().values()))

    # -- one request ------------------------------------------------------------------------------
    async def _forward(self, request_id, prompt, params, sink: asyncio.Queue, accepted: asyncio.Future) -> None:
        why = "no replica answered"
        for attempt in range(ATTEMPTS):
            started = False
            response = self.handle.options(stream=True).generate.remote(request_id, prompt, params)
            try:
                async for message in response:
                    if isinstance(message, str) and message == ACCEPTED:
                        settle(accepted, None)
                    elif isinstance(message, BaseException):    # refused: a bad parameter, or not ready
                        if accepted.done():     # by a second replica, after the first had accepted it
                            sink.put_nowait(EngineItem(request_id, None, time.monotonic(), error=str(message)))
                        settle(accepted, message)
                        return
                    else:
                        started = True
                        sink.put_nowait(message)
                        if message.error is not None or message.output.finished:
                            return
                why = "its stream ended early"
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as e:      # noqa: BLE001 - the replica died or could not be reached
                why = type(e).__name__
            if started or attempt + 1 == ATTEMPTS:
                log.warning("request %s: its replica failed (%s)", request_id, why)
                break
            log.warning("request %s: its replica failed (%s) before any output; sending it again (attempt %d of %d)",
                        request_id, why, attempt + 2, ATTEMPTS)
            await asyncio.sleep(RETRY_WAIT)
        message = f"the engine replica serving this request failed ({why})"
        if not accepted.done():
            accepted.set_exception(EngineFailure(message))
        else:
            sink.put_nowait(EngineItem(request_id, None, time.monotonic(), error=message))


def sum_stats(stats: list[EngineStats]) -> EngineStats | None:
    """Counters and gauges summed over replicas; per-position counts summed position by position."""
    if not stats:
        return None
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], str):
            total[f.name] = next((v for v in values if v), "")
        elif isinstance(values[0], (tuple, list)):
            width = max(map(len, values))
            total[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            total[f.name] = sum(values)
    total["kv_cache_usage"] = 1.0 - total["num_free_pages"] / total["num_pages"] if total["num_pages"] else 0.0
    return EngineStats(**total)
