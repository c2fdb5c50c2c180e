"""/v1/completions: prompts (text or token ids, one or several) to engine requests, and their
outputs to OpenAI's legacy completion responses, whole or streamed.

Scoring text, as lm-evaluation-harness and vLLM's clients do it: `echo` puts the prompt before
each choice's text and, with `logprobs`, the prompt's tokens before its own in the logprobs (the
first prompt token has none: null, as in vLLM); `max_tokens: 0` with echo scores the prompt
only (the engine generates one token, which is not shown nor counted). vLLM's `prompt_logprobs`
adds, per choice, each prompt token's logprob, rank and top-k candidates by token id. Both read
the engine's prompt log-probabilities (SamplingParams.prompt_logprobs), which keep the request
off the prefix cache: every prompt position is computed. A response that shows the prompt is
built in a tokenizer worker: it grows with the prompt, and on the event loop it would stall
every stream.
"""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ridge.engine.request import CompletionOutput, RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.server.logprobs import TextOffsets, TokenText, completion_logprobs, prompt_logprobs
from ridge.server.openai_serving import OpenAIServing, RequestGroup, SampleStream, next_piece, sse, usage
from ridge.server.protocol import CompletionChoice, CompletionResponse
from ridge.server.text_stream import TextDelta


class CompletionServing(OpenAIServing):
    async def __call__(self, req, raw: Request) -> Response:
        self.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else list(req.prompt)
        only_prompt = req.echo and req.max_tokens == 0
        # the engine scores the prompt for the larger of what echo's logprobs and prompt_logprobs show
        shown = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        rename = {}
        params = self.params(req, 1 if only_prompt else req.max_tokens, None if only_prompt else req.logprobs, rename,
                             max(shown) if shown else None)
        group = RequestGroup(self.client, self.metrics, f"cmpl-{uuid.uuid4().hex}")
        await group.submit(prompts, params, rename, req.parse_special_tokens)
        if req.stream:
            return self.streaming_response(group, self._events(group, req, params))
        finals = await self.collect(group, raw)
        if finals is None:
            return Response(status_code=499)
        if req.echo or req.prompt_logprobs is not None:
            return await self.client.run_in_worker(self._response, group.base_id, req, params, finals)
        return self._response(group.base_id, req, params, finals)

    def _response(self, base_id: str, req, params: SamplingParams, finals: list[RequestOutput]) -> JSONResponse:
        choices = []
        for p, out in enumerate(finals):
            prompt = PromptShown(self.client, req, out, params.skip_special_tokens)
            for c in out.outputs:
                offsets = TextOffsets(params.skip_special_tokens)
                text, lps, reason = prompt.text, prompt.logprobs(offsets), prompt.finish_reason
                if reason is None:
                    reason = c.finish_reason
                    text += c.text
                    if c.logprobs is not None:
                        lps = _joined(lps, completion_logprobs(c.token_ids, c.logprobs, offsets))
                choices.append(CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lps,
                                                finish_reason=reason, prompt_logprobs=prompt.prompt_logprobs))
        body = CompletionResponse(id=base_id, model=self.cfg.model_name, choices=choices,
                                  usage=usage(finals, generated=not (req.echo and req.max_tokens == 0)))
        return JSONResponse(body.model_dump())          # rendered here: in the worker when it shows the prompt

    async def _events(self, group: RequestGroup, req, params: SamplingParams):
        created = int(time.time())
        usage_opt = req.stream_options is not None and req.stream_options.include_usage
        shows_prompt = req.echo or req.prompt_logprobs is not None

        def chunk(choices, counts=None):
            body = CompletionResponse(id=group.base_id, created=created, model=self.cfg.model_name,
                                      choices=choices).model_dump()
            if usage_opt:
                body["usage"] = counts
            else:
                body.pop("usage")
            return sse(body)

        streams, finals = {}, {}
        async for item in group.items():
            p = group.index_of(item.request_id)
            for c in item.output.outputs:
                key, index = (p, c.index), p * req.n + c.index
                if shows_prompt and key not in streams:     # the prompt's chunk comes first
                    st = streams[key] = SampleStream(TextDelta(params.stop_strings),
                                                     TextOffsets(params.skip_special_tokens))
                    first = await self.client.run_in_worker(self._prompt_choice, req, item.output, c, index, st)
                    yield chunk([first])
                piece = next_piece(streams, key, c, params)
                if piece is None:
                    continue
                text, reason, new_tokens, new_lps = piece
                offsets = streams[key].offsets
                lps = completion_logprobs(new_tokens, new_lps, offsets) if new_lps is not None else None
                yield chunk([CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=reason)])
            if item.output.finished:
                finals[item.request_id] = item.output
        if usage_opt:
            outs = [finals[rid] for rid in group.ids]
            yield chunk([], usage(outs, generated=not (req.echo and req.max_tokens == 0)).model_dump())

    def _prompt_choice(self, req, out: RequestOutput, c: CompletionOutput, index: int,
                       st: SampleStream) -> CompletionChoice:
        """A stream's first chunk of a choice: the echoed prompt and its logprobs (moving the
        stream's offsets past it), vLLM's prompt_logprobs; the last chunk when only the prompt is
        shown."""
        prompt = PromptShown(self.client, req, out, st.offsets.skip_special)
        st.done = prompt.finish_reason is not None
        return CompletionChoice(index=index, text=prompt.text, logprobs=prompt.logprobs(st.offsets),
                                finish_reason=prompt.finish_reason, prompt_logprobs=prompt.prompt_logprobs)


class PromptShown:
    """What each choice of one prompt shows of the prompt: the echoed text and tokens, and
    vLLM's prompt_logprobs; `finish_reason` is "length" when the choice shows nothing else."""

    def __init__(self, client, req, out: RequestOutput, skip_special_tokens: bool):
        self.req, self.out = req, out
        self.finish_reason = "length" if req.echo and req.max_tokens == 0 else None
        self.text, self.first = "", None
        if req.echo:
            ids = out.prompt_token_ids
            names = [TokenText(*t) for t in client.token_texts(ids if out.prompt is None else ids[:1])]
            self.first = names[0]
            if out.prompt is not None:
                self.text = out.prompt
            else:                                       # token ids: the text their tokens spell
                spelled = TextOffsets(skip_special_tokens)
                for name in names:
                    spelled.advance(name)
                self.text = spelled.text
        self.prompt_logprobs = (prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs)
                                if req.prompt_logprobs is not None else None)

    def logprobs(self, offsets: TextOffsets):
        """The echoed prompt tokens' logprobs (None without echo or logprobs); moves `offsets` on."""
        if not self.req.echo or self.req.logprobs is None:
            return None
        return completion_logprobs(self.out.prompt_token_ids, self.out.prompt_logprobs, offsets, self.req.logprobs,
                                   unscored=self.first)


def _joined(a, b):
    """Two runs of legacy logprobs, one after the other (either may be None)."""
    if a is None or b is None:
        return b if a is None else a
    return type(a)(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                   top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)
