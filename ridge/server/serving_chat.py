"""/v1/chat/completions: a conversation (and its tools) rendered by the checkpoint's chat template
(in a tokenizer worker) to one engine request, and its outputs to OpenAI's chat responses, whole or
streamed (a first chunk per choice carries the role; each chunk's delta only what it sets). What each
sample's text becomes (chat_answers.py): its reasoning split off by the server's --reasoning-parser,
then tool calls: a forced choice is held to its shape by a structured output, "auto" is read by the
server's --tool-call-parser (chat_tools.py)."""
from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ridge.engine.sampling_params import SamplingParams
from ridge.server.chat_answers import ChatReader
from ridge.server.chat_tools import without_nulls
from ridge.server.engine_client import ChatPrompt
from ridge.server.logprobs import chat_logprobs
from ridge.server.openai_serving import OpenAIServing, RequestGroup, next_piece, sse, usage
from ridge.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionResponse, DeltaMessage)


class ChatServing(OpenAIServing):
    async def __call__(self, req, raw: Request) -> Response:
        self.check_model(req.model)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        max_tokens, max_name = req.max_new_tokens
        rename = {"logprobs": "top_logprobs", "max_tokens": max_name, "prompt": "messages"}
        reader = ChatReader.of(req, self.cfg.tool_call_parser, self.cfg.reasoning_parser)
        extra = {"skip_special_tokens": False} if reader.keeps_special_tokens else {}
        params = self.params(req, max_tokens, top if req.logprobs else None, rename, **extra)
        if reader.grammar_after is not None:      # the grammar holds the answer after the reasoning
            params.structured_outputs = dataclasses.replace(params.structured_outputs, start_after=reader.grammar_after)
        group = RequestGroup(self.client, self.metrics, f"chatcmpl-{uuid.uuid4().hex}")
        prompt = ChatPrompt([m.as_template_input() for m in req.messages], req.tool_definitions)
        await group.submit([prompt], params, rename)
        if req.stream:
            return self.streaming_response(group, self._events(group, req, params, top, reader))
        finals = await self.collect(group, raw)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = []
        for c in out.outputs:
            message, reason = reader.message(c.text, c.finish_reason)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=reason,
                                      logprobs=chat_logprobs(c.token_ids, c.logprobs, top)
                                      if c.logprobs is not None else None))
        body = ChatCompletionResponse(id=group.base_id, model=self.cfg.model_name, choices=choices,
                                      usage=usage(finals)).model_dump()
        for choice in body["choices"]:          # tool_calls only where calls were made, reasoning
            message = choice["message"]         # only from a server that splits it off
            if message["tool_calls"] is None:
                del message["tool_calls"]
            if not reader.shows_reasoning:
                del message["reasoning"], message["reasoning_content"]
        return JSONResponse(body)

    async def _events(self, group: RequestGroup, req, params: SamplingParams, top: int, reader: ChatReader):
        created = int(time.time())
        usage_opt = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices, counts=None):
            body = ChatCompletionChunk(id=group.base_id, created=created, model=self.cfg.model_name,
                                       choices=choices).model_dump()
            for choice in body["choices"]:      # a delta carries only what it sets
                choice["delta"] = without_nulls(choice["delta"])
            if usage_opt:
                body["usage"] = counts
            return sse(body)

        answers = {j: reader.stream() for j in range(req.n)}
        for j in range(req.n):
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            for delta in answers[j].head():
                yield chunk([ChatChunkChoice(index=j, delta=delta)])
        streams, final = {}, None
        async for item in group.items():
            for c in item.output.outputs:
                piece = next_piece(streams, c.index, c, params)
                if piece is None:
                    continue
                text, reason, new_tokens, new_lps = piece
                lps = chat_logprobs(new_tokens, new_lps, top) if new_lps is not None else None
                deltas, reason = answers[c.index].step(text, reason)
                for k, delta in enumerate(deltas):     # the token's logprobs on the first, the reason on the last
                    last = k == len(deltas) - 1
                    yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lps if k == 0 else None,
                                                 finish_reason=reason if last else None)])
            if item.output.finished:
                final = item.output
        if usage_opt:
            yield chunk([], usage([final]).model_dump())
