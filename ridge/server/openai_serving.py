"""/v1/completions and /v1/chat/completions: from a parsed request to engine requests, and from
engine outputs to OpenAI responses, whole or streamed as server-sent events.

Parameter checks are split by who can make them: the engine validates everything it knows
(ranges, the context length, n against max_n, token ids against the vocabulary) and its
ValueError becomes a 400 naming the parameter; this module adds only what the protocol or the
server's caps demand (temperature <= 2 is in the schema; stop-string count and length,
logprobs cap, top_logprobs needing logprobs, stream_options needing stream, unsupported
OpenAI fields).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ridge.engine.request import CompletionOutput, RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.server.config import ServerConfig
from ridge.server.engine_client import ChatPrompt, EngineClient, EngineFailure, EngineItem, EngineUnavailable
from ridge.server.errors import APIError, bad_request, from_value_error
from ridge.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from ridge.server.metrics import ServerMetrics
from ridge.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                   ChatCompletionResponse, ChatChunkChoice, CompletionChoice, CompletionRequest,
                                   CompletionResponse, DeltaMessage, UNSUPPORTED_CHAT, Usage)
from ridge.server.text_stream import TextDelta


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
            raise from_value_error(e, rename) from None
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


class OpenAIServing:
    def __init__(self, client: EngineClient, metrics: ServerMetrics, cfg: ServerConfig):
        self.client, self.metrics, self.cfg = client, metrics, cfg

    # -- /v1/completions -------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        if req.echo:
            raise bad_request("echo", "is not supported by this server")
        if req.suffix is not None:
            raise bad_request("suffix", "is not supported by this server")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise bad_request("best_of", "is not supported by this server (only best_of = n)")
        self._check_common(req, "logprobs", req.logprobs)
        prompts = self._prompts(req.prompt)
        params = self._params(req, req.max_tokens, req.logprobs, {})
        group = RequestGroup(self.client, self.metrics, f"cmpl-{uuid.uuid4().hex}")
        await group.submit(prompts, params, {}, req.parse_special_tokens)
        if req.stream:
            return self._streaming_response(group, self._completion_events(group, req, params))
        finals = await self._collect(group, raw)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                lps = (completion_logprobs(c.token_ids, c.logprobs, TextOffsets(params.skip_special_tokens))
                       if c.logprobs is not None else None)
                choices.append(CompletionChoice(index=p * req.n + c.index, text=c.text, logprobs=lps,
                                                finish_reason=c.finish_reason))
        resp = CompletionResponse(id=group.base_id, model=self.cfg.model_name, choices=choices, usage=_usage(finals))
        return JSONResponse(resp.model_dump())

    async def _completion_events(self, group: RequestGroup, req: CompletionRequest, params: SamplingParams):
        created = int(time.time())
        usage_opt = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices, usage=None):
            body = CompletionResponse(id=group.base_id, created=created, model=self.cfg.model_name,
                                      choices=choices).model_dump()
            if usage_opt:
                body["usage"] = usage
            else:
                body.pop("usage")
            return _sse(body)

        streams, finals = {}, {}
        async for item in group.items():
            p = group.index_of(item.request_id)
            for c in item.output.outputs:
                piece = _next_piece(streams, (p, c.index), c, params)
                if piece is None:
                    continue
                text, reason, new_tokens, new_lps = piece
                offsets = streams[(p, c.index)].offsets
                lps = completion_logprobs(new_tokens, new_lps, offsets) if new_lps is not None else None
                yield chunk([CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lps, finish_reason=reason)])
            if item.output.finished:
                finals[item.request_id] = item.output
        if usage_opt:
            yield chunk([], _usage([finals[rid] for rid in group.ids]).model_dump())

    # -- /v1/chat/completions ----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        if not req.messages:
            raise bad_request("messages", "must not be empty")
        if req.tools:
            raise bad_request("tools", "tool calling is not supported by this server")
        for name, harmless in UNSUPPORTED_CHAT.items():
            if getattr(req, name) not in harmless:
                raise bad_request(name, "is not supported by this server")
        for i, m in enumerate(req.messages):
            if m.tool_calls:
                raise bad_request(f"messages[{i}].tool_calls", "tool calling is not supported by this server")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise bad_request("response_format", "only {\"type\": \"text\"} is supported by this server")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "requires logprobs to be true")
        top = req.top_logprobs if req.top_logprobs is not None else 0
        self._check_common(req, "top_logprobs", top if req.logprobs else None)
        if req.max_completion_tokens is not None:
            max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_name = req.max_tokens, "max_tokens"
        rename = {"logprobs": "top_logprobs", "max_tokens": max_name, "prompt": "messages"}
        params = self._params(req, max_tokens, top if req.logprobs else None, rename)
        group = RequestGroup(self.client, self.metrics, f"chatcmpl-{uuid.uuid4().hex}")
        await group.submit([ChatPrompt([m.as_template_input() for m in req.messages])], params, rename)
        if req.stream:
            return self._streaming_response(group, self._chat_events(group, req, params, top))
        finals = await self._collect(group, raw)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=chat_logprobs(c.token_ids, c.logprobs, top) if c.logprobs is not None else None,
                              finish_reason=c.finish_reason) for c in out.outputs]
        resp = ChatCompletionResponse(id=group.base_id, model=self.cfg.model_name, choices=choices, usage=_usage(finals))
        return JSONResponse(resp.model_dump())

    async def _chat_events(self, group: RequestGroup, req: ChatCompletionRequest, params: SamplingParams, top: int):
        created = int(time.time())
        usage_opt = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices, usage=None):
            body = ChatCompletionChunk(id=group.base_id, created=created, model=self.cfg.model_name,
                                       choices=choices).model_dump()
            for choice in body["choices"]:      # a delta carries only what it sets
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if usage_opt:
                body["usage"] = usage
            return _sse(body)

        for j in range(req.n):
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
        streams, final = {}, None
        async for item in group.items():
            for c in item.output.outputs:
                piece = _next_piece(streams, c.index, c, params)
                if piece is None:
                    continue
                text, reason, new_tokens, new_lps = piece
                lps = chat_logprobs(new_tokens, new_lps, top) if new_lps is not None else None
                yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=lps,
                                             finish_reason=reason)])
            if item.output.finished:
                final = item.output
        if usage_opt:
            yield chunk([], _usage([final]).model_dump())

    # -- shared ------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        """Only the served name (or none) is accepted: taking the checkpoint's path too would let a
        client probe the server's filesystem layout, and /v1/models names just the one model."""
        if model is None or model == self.cfg.model_name:
            return
        shown = model if len(model) <= 64 else model[:61] + "..."
        raise APIError(404, f"model: the model {shown!r} does not exist; this server serves {self.cfg.model_name!r}",
                       "model", "model_not_found")

    def _check_common(self, req, logprobs_name: str, logprobs: int | None) -> None:
        cfg = self.cfg
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > cfg.max_stop:
            raise bad_request("stop", f"at most {cfg.max_stop} stop strings, got {len(stops)}")
        if any(len(s) > cfg.max_stop_chars for s in stops):
            raise bad_request("stop", f"a stop string may have at most {cfg.max_stop_chars} characters")
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(logprobs_name, f"must be <= {cfg.max_logprobs}, got {logprobs}")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options", "is only allowed when stream is true")
        if req.logit_bias:
            raise bad_request("logit_bias", "is not supported by this server")

    def _prompts(self, prompt) -> list:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise bad_request("prompt", "must not be empty")
        if len(prompt) > self.cfg.max_prompts:
            raise bad_request("prompt", f"at most {self.cfg.max_prompts} prompts per request, got {len(prompt)}")
        return list(prompt)

    def _params(self, req, max_tokens, logprobs, rename) -> SamplingParams:
        kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos,
                  logprobs=logprobs)
        kw.update({k: getattr(req, k) for k in _OPTIONAL_SAMPLING if getattr(req, k) is not None})
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise from_value_error(e, rename) from None

    async def _collect(self, group: RequestGroup, raw: Request) -> list[RequestOutput] | None:
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

    def _streaming_response(self, group: RequestGroup, events) -> StreamingResponse:
        async def stream():
            try:
                async for event in events:
                    yield event
            except EngineFailure as e:
                yield _sse(APIError(e.status, str(e), None, e.code).body())
            finally:
                group.abort()       # the client went away mid-stream (cancellation lands here)
            yield "data: [DONE]\n\n"

        # the background task runs even if the stream was cancelled before it started
        return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS,
                                 background=BackgroundTask(group.abort))


@dataclass
class _SampleStream:
    text: TextDelta
    offsets: TextOffsets     # where the next token's text starts (legacy completions' text_offset)
    tokens: int = 0          # tokens already sent (their logprobs went out with them)
    done: bool = False


def _next_piece(streams: dict, key, c: CompletionOutput, params: SamplingParams):
    """What sample `c` adds since it was last shown: (text, finish_reason, new token ids, their
    logprob entries or None), or None when it has no new token. TextDelta holds text back so
    that no stop string shows, not even a part of one. A new token whose text is held back (or
    is an incomplete UTF-8 character) still gets a chunk, with empty text: a stream has one
    chunk per generated token, so clients can time every token."""
    st = streams.get(key)
    if st is None:
        st = streams[key] = _SampleStream(TextDelta(params.stop_strings), TextOffsets(params.skip_special_tokens))
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


def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
