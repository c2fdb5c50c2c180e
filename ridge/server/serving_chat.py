"""/v1/chat/completions: a conversation rendered by the checkpoint's chat template (in a
tokenizer worker) to one engine request, and its outputs to OpenAI's chat responses, whole or
streamed (a first chunk per choice carries the role; each chunk's delta only what it sets)."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ridge.engine.sampling_params import SamplingParams
from ridge.server.engine_client import ChatPrompt
from ridge.server.logprobs import chat_logprobs
from ridge.server.openai_serving import OpenAIServing, RequestGroup, next_piece, sse, usage
from ridge.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionResponse, DeltaMessage)


class ChatServing(OpenAIServing):
    async def __call__(self, req, raw: Request) -> Response:
        self.check_model(req.model)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        max_tokens, max_name = req.max_new_tokens
        rename = {"logprobs": "top_logprobs", "max_tokens": max_name, "prompt": "messages"}
        params = self.params(req, max_tokens, top if req.logprobs else None, rename)
        group = RequestGroup(self.client, self.metrics, f"chatcmpl-{uuid.uuid4().hex}")
        await group.submit([ChatPrompt([m.as_template_input() for m in req.messages])], params, rename)
        if req.stream:
            return self.streaming_response(group, self._events(group, req, params, top))
        finals = await self.collect(group, raw)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=chat_logprobs(c.token_ids, c.logprobs, top) if c.logprobs is not None else None,
                              finish_reason=c.finish_reason) for c in out.outputs]
        resp = ChatCompletionResponse(id=group.base_id, model=self.cfg.model_name, choices=choices, usage=usage(finals))
        return JSONResponse(resp.model_dump())

    async def _events(self, group: RequestGroup, req, params: SamplingParams, top: int):
        created = int(time.time())
        usage_opt = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices, counts=None):
            body = ChatCompletionChunk(id=group.base_id, created=created, model=self.cfg.model_name,
                                       choices=choices).model_dump()
            for choice in body["choices"]:      # a delta carries only what it sets
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if usage_opt:
                body["usage"] = counts
            return sse(body)

        for j in range(req.n):
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
        streams, final = {}, None
        async for item in group.items():
            for c in item.output.outputs:
                piece = next_piece(streams, c.index, c, params)
                if piece is None:
                    continue
                text, reason, new_tokens, new_lps = piece
                lps = chat_logprobs(new_tokens, new_lps, top) if new_lps is not None else None
                yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=lps,
                                             finish_reason=reason)])
            if item.output.finished:
                final = item.output
        if usage_opt:
            yield chunk([], usage([final]).model_dump())
