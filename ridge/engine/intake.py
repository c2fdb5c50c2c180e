"""Request intake: a caller's prompt and SamplingParams become a validated Request with one
Sequence per sample, or a ValueError naming what is wrong. Nothing here touches the scheduler,
so a rejected request leaves the engine and every accepted request as they were.
"""
from __future__ import annotations

import itertools
import random

from ridge.config import EngineConfig, ModelConfig
from ridge.engine.request import Request, Sequence, SeqStatus
from ridge.engine.sampling_params import SamplingParams


class Intake:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tokenizer, detokenizer, pages_for):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.tokenizer, self.detokenizer = tokenizer, detokenizer
        self.pages_for = pages_for                      # tokens -> KV pages they occupy
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def make_request(self, prompt: str | list[int], params: SamplingParams | None,
                     request_id: str | None) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.validate(max_n=min(self.cfg.max_n, self.cfg.max_num_seqs))
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {type(request_id).__name__}")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self.check_lengths(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{self.next_id()}"
        req = Request(request_id, text, token_ids, params, max_tokens)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        for j in range(params.n):
            seq = Sequence(self.next_id(), req, j, list(token_ids), len(token_ids),
                           seed=sample_seed(base_seed, j),
                           status=SeqStatus.WAITING if j == 0 else SeqStatus.UNBORN,
                           logprobs=[] if params.logprobs is not None else None,
                           prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs and j == 0 else None)
            if self.detokenizer is not None:
                seq.detokenizer = self.detokenizer.stream(params.skip_special_tokens)
            req.seqs.append(seq)
        return req

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model directory has no tokenizer; pass token ids")
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids (integers)")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """The request's output budget; raises if the prompt and max_tokens cannot fit."""
        max_len, n_prompt = self.cfg.max_model_len, len(token_ids)
        if n_prompt >= max_len:
            raise ValueError(f"prompt: {n_prompt} tokens leave no room for output within max_model_len={max_len}")
        room = max_len - n_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"max_tokens: {max_tokens} exceeds the {room} tokens left in the context "
                             f"(max_model_len={max_len}, prompt={n_prompt})")
        pages = self.pages_for(n_prompt + max_tokens)
        if pages > self.cfg.num_pages:
            raise ValueError(f"max_tokens: prompt + max_tokens = {n_prompt + max_tokens} tokens need {pages} KV pages, "
                             f"but the cache holds {self.cfg.num_pages}")
        return max_tokens


def sample_seed(base: int, index: int) -> int:
    """Sample j of a request draws from its own stream; sample 0 uses the request's seed itself."""
    return base if index == 0 else random.Random(base * 1_000_003 + index).getrandbits(63)
