"""Request intake: a caller's prompt and SamplingParams become a validated Request with one
Sequence per sample, or a ValueError naming what is wrong. Nothing here touches the scheduler,
so a rejected request leaves the engine and every accepted request as they were.
"""
from __future__ import annotations

import itertools
import random
import threading

from tokenizers.decoders import DecodeStream

from ridge.config import EngineConfig, ModelConfig
from ridge.engine.prompts import PromptEncoder, TokenizedPrompt
from ridge.engine.request import ContextLengthError, Request, Sequence, SeqStatus
from ridge.engine.sampling_params import SamplingParams, _is_int
from ridge.engine.structured import Grammars


class Intake:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tokenizer, pages_for):
        self.cfg, self.model_cfg, self.tokenizer = cfg, model_cfg, tokenizer
        self.encoder = PromptEncoder(tokenizer, cfg.max_model_len) if tokenizer is not None else None
        self.pages_for = pages_for                      # tokens -> KV pages they occupy
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        # structured outputs' grammars and masks (None without a tokenizer); XGrammar's tables are made
        # when the first grammar is compiled
        self.grammars = Grammars(tokenizer, model_cfg.vocab_size, list(model_cfg.eos_token_ids)) \
            if tokenizer is not None else None

    def compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (None without a structured output), cached: a server calls
        this in a worker thread before it queues the request, so the engine thread finds it made.
        A ValueError names what XGrammar could not compile."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs: needs the model's tokenizer (the engine was made without one)")
        return self.grammars.compile(so)

    def grammar_matchers(self, params: SamplingParams) -> list | None:
        """A matcher per sample for the request's structured output (None without one)."""
        if self.compile_grammar(params) is None:
            return None
        return [self.grammars.matcher(params.structured_outputs) for _ in range(params.n)]

    def make_request(self, prompt: str | list[int] | TokenizedPrompt, params: SamplingParams | None,
                     request_id: str | None, in_use) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.validate(max_n=min(self.cfg.max_n, self.cfg.max_num_seqs))
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {type(request_id).__name__}")
        text, token_ids = self.tokenize(prompt)
        max_len, n_prompt = self.cfg.max_model_len, len(token_ids)
        if n_prompt >= max_len:
            raise ContextLengthError(f"prompt: {n_prompt} tokens leave no room for output within "
                                     f"max_model_len={max_len}")
        room = max_len - n_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ContextLengthError(f"max_tokens: {max_tokens} exceeds the {room} tokens left in the context "
                                     f"(max_model_len={max_len}, prompt={n_prompt})")
        if (pages := self.pages_for(n_prompt + max_tokens)) > self.cfg.num_pages:
            raise ContextLengthError(f"max_tokens: prompt + max_tokens = {n_prompt + max_tokens} tokens need {pages} "
                                     f"KV pages, but the cache holds {self.cfg.num_pages}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in in_use:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        matchers = self.grammar_matchers(params)
        req = Request(request_id, text, token_ids, params, max_tokens)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        for j in range(params.n):
            # sample j draws from its own stream; sample 0 uses the request's seed itself
            seed = base_seed if j == 0 else random.Random(base_seed * 1_000_003 + j).getrandbits(63)
            seq = Sequence(next(self._ids), req, j, list(token_ids), len(token_ids), seed=seed,
                           status=SeqStatus.WAITING if j == 0 else SeqStatus.UNBORN,
                           logprobs=[] if params.logprobs is not None else None,
                           prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None and j == 0 else None)
            seq.grammar = matchers[j] if matchers is not None else None
            seq.grammar_after = params.structured_outputs.start_after if matchers is not None else None
            if self.tokenizer is not None:      # emits text once a whole UTF-8 piece is known
                seq.detokenizer = DecodeStream(skip_special_tokens=params.skip_special_tokens)
            req.seqs.append(seq)
        return req

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: text is encoded here (in the caller's thread), special-
        token strings as plain text; a TokenizedPrompt was encoded by the caller already."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt.text, list(prompt.token_ids)
        text = prompt if isinstance(prompt, str) else None
        if text is not None and self.tokenizer is None:
            raise ValueError("prompt: this model directory has no tokenizer; pass token ids")
        if text is None and (not isinstance(prompt, (list, tuple)) or not all(map(_is_int, prompt))):
            raise ValueError("prompt: must be a string or a list of token ids (integers)")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if text is not None:
            return text, self.encoder.encode(text)
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        return None, list(prompt)


def prompt_list(prompts) -> list:
    """`LLM.generate`'s prompts as a list: one prompt (a string or token ids) or a list of them.
    Each prompt itself is checked when its request is made."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and _is_int(prompts[0])):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a string, a list of token ids or a list of those, "
                         f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: the list is empty")
    return list(prompts)


def sampling_list(params, count: int) -> list[SamplingParams]:
    """One SamplingParams for each of `count` prompts, from None, one SamplingParams or a list."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if isinstance(params, dict):
        raise ValueError("sampling_params: expected SamplingParams, got a dict; write SamplingParams(**your_dict)")
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params: expected SamplingParams or a list of them, got {type(params).__name__}")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params: expected SamplingParams in the list, got {type(bad).__name__}")
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return list(params)
