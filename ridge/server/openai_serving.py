"""What /v1/completions and /v1/chat/completions share (serving_completions.py, serving_chat.py):
the engine requests behind one HTTP request, sampling parameters, collecting outputs, and
streaming them as server-sent events.

Parameter checks are split by who can make them: the request models (request_models.py)
check every value and combination the schema states, the caps of ServerConfig included; the
engine checks what depends on the prompt's tokens (the context length, the KV cache), and its
ValueError becomes a 400 naming the parameter.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ridge.engine.request import CompletionOutput, ContextLengthError, RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.structured import StructuredOutputError
from ridge.server.config import ServerConfig
from ridge.server.engine_client import EngineClient, EngineFailure, EngineItem, EngineUnavailable
from ridge.server.errors import CONTEXT_LENGTH_EXCEEDED, APIError, from_value_error
from ridge.server.logprobs import TextOffsets
from ridge.server.metrics import ServerMetrics
from ridge.server.protocol import Usage
from ridge.server.text_stream import TextDelta


_STRUCTURED_SUFFIXES = ("", ".json", ".json_object", ".regex", ".choice", ".grammar")
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "min_tokens")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), sharing one queue."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics, base_id: str):
        self.client, self.metrics, self.base_id = client, metrics, base_id
        self.sink: asyncio.Queue[EngineItem] = asyncio.Queue()
        self.ids: list[str] = []
        self.pending: set[str] = set()
        self._last_time: dict[str, float] = {}

    async def submit(self, prompts: list, params: SamplingParams, rename: dict[str, str],
                     parse_special_tokens: bool = False) -> None:
        """Queue one engine request per prompt, all in one go (they join the same step); all or
        nothing: if one is refused, the accepted ones are aborted and the refusal raised."""
        self.ids = [f"{self.base_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(*(self.client.add(rid, p, params, self.sink, parse_special_tokens)
                                         for rid, p in zip(self.ids, prompts)), return_exceptions=True)
        refused = [r for r in results if r is not None]
        if not refused:
            self.pending.update(self.ids)
            return
        for rid, r in zip(self.ids, results):
            if r is None:
                self.client.abort(rid)
        e = refused[0]
        if isinstance(e, ValueError):
            code = CONTEXT_LENGTH_EXCEEDED if isinstance(e, ContextLengthError) else error_code(e)
            raise from_value_error(e, rename, code) from None
        if isinstance(e, EngineUnavailable):
            raise APIError(503, str(e), None, "engine_not_ready") from None
        if isinstance(e, EngineFailure):
            raise APIError(500, str(e), None, "engine_error") from None
        raise e

    async def items(self):
        """Engine items until every request has finished; EngineFailure if one failed."""
        while self.pending:
            item = await self.sink.get()
            rid = item.request_id
            if rid not in self.pending:
                continue
            if item.error is not None:
                self.pending.discard(rid)
                self.metrics.finished.labels("error").inc()
                self.abort()
                raise item.failure()
            last = self._last_time.get(rid)
            if last is not None:
                self.metrics.itl.observe(item.time - last)
            self._last_time[rid] = item.time
            if item.output.finished:
                self.pending.discard(rid)
                self.metrics.observe_finished(item.output)
            yield item

    def abort(self) -> None:
        """Abort what has not finished (the client left, or a sibling request failed); the
        engine frees the pages. Idempotent."""
        for rid in self.pending:
            self.client.abort(rid)
            self.metrics.finished.labels("abort").inc()
        self.pending.clear()

    def index_of(self, rid: str) -> int:
        return self.ids.index(rid)


def error_code(e: ValueError) -> str:
    return "invalid_structured_output" if isinstance(e, StructuredOutputError) else "invalid_parameter"


class OpenAIServing:
    def __init__(self, client: EngineClient, metrics: ServerMetrics, cfg: ServerConfig):
        self.client, self.metrics, self.cfg = client, metrics, cfg

    def check_model(self, model: str | None) -> None:
        """Only the served name (or none) is accepted: taking the checkpoint's path too would let a
        client probe the server's filesystem layout, and /v1/models names just the one model."""
        if model is None or model == self.cfg.model_name:
            return
        shown = model if len(model) <= 64 else model[:61] + "..."
        raise APIError(404, f"model: the model {shown!r} does not exist; this server serves {self.cfg.model_name!r}",
                       "model", "model_not_found")

    def params(self, req, max_tokens, logprobs, rename, prompt_logprobs: int | None = None, **extra) -> SamplingParams:
        """The request's SamplingParams (and `extra` fields). `rename` (the engine's parameter names to
        this endpoint's) gains the field a structured output came from, for the errors of building and
        compiling it."""
        kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs, **extra)
        kw.update({k: getattr(req, k) for k in _OPTIONAL_SAMPLING if getattr(req, k) is not None})
        structured, source = req.structured()
        if structured is not None:
            kw["structured_outputs"] = structured
            if source != "structured_outputs":
                rename.update({f"structured_outputs{sub}": source for sub in _STRUCTURED_SUFFIXES})
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise from_value_error(e, rename, error_code(e)) from None

    async def collect(self, group: RequestGroup, raw: Request) -> list[RequestOutput] | None:
        """The final outputs, in prompt order; None if the client went away first (then the
        requests are aborted and their pages freed)."""
        finals = {}

        async def consume():
            async for item in group.items():
                if item.output.finished:
                    finals[item.request_id] = item.output

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            group.abort()
        if not work.done() or work.cancelled():
            return None
        try:
            work.result()
        except EngineFailure as e:
            raise APIError(e.status, str(e), None, e.code) from None
        return [finals[rid] for rid in group.ids]

    def streaming_response(self, group: RequestGroup, events) -> StreamingResponse:
        async def stream():
            try:
                async for event in events:
                    yield event
            except EngineFailure as e:
                yield sse(APIError(e.status, str(e), None, e.code).body())
            finally:
                group.abort()       # the client went away mid-stream (cancellation lands here)
            yield "data: [DONE]\n\n"

        # the background task runs even if the stream was cancelled before it started
        return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS,
                                 background=BackgroundTask(group.abort))


@dataclass
class SampleStream:
    text: TextDelta
    offsets: TextOffsets     # where the next token's text starts (legacy completions' text_offset)
    tokens: int = 0          # tokens already sent (their logprobs went out with them)
    done: bool = False


def next_piece(streams: dict, key, c: CompletionOutput, params: SamplingParams):
    """What sample `c` adds since it was last shown: (text, finish_reason, new token ids, their
    logprob entries or None), or None when it has no new token. TextDelta holds text back so
    that no stop string shows, not even a part of one. A new token whose text is held back (or
    is an incomplete UTF-8 character) still gets a chunk, with empty text: a stream has one
    chunk per generated token, so clients can time every token."""
    st = streams.get(key)
    if st is None:
        st = streams[key] = SampleStream(TextDelta(params.stop_strings), TextOffsets(params.skip_special_tokens))
    if st.done:
        return None             # a finished sample stays in its request's later outputs
    finished = c.finish_reason is not None
    text = st.text.delta(c.text, finished)
    new_tokens = c.token_ids[st.tokens:]
    new_lps = c.logprobs[st.tokens:] if c.logprobs is not None else None
    st.tokens, st.done = len(c.token_ids), finished
    if not new_tokens and not finished:
        return None
    return text, c.finish_reason, new_tokens, new_lps


def usage(finals: list[RequestOutput], generated: bool = True) -> Usage:
    """Token counts; `generated` False: the completions were not shown (echo with max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs) if generated else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
