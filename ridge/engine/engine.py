"""The engine: validates and queues requests, and runs the step loop.

    step = schedule -> prepare + forward (runner) -> sample -> update

Everything a step calls lives in its own module; this file only wires them together.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

from ridge.config import EngineConfig, ModelConfig
from ridge.engine.block_manager import BlockManager
from ridge.engine.detokenizer import Detokenizer
from ridge.engine.request import Logprob, Request, RequestOutput, Sequence, SeqStatus
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.scheduler import Scheduler, SchedulerOutput
from ridge.runner.model_runner import ModelRunner


@dataclass
class EngineStats:
    """A snapshot for metrics endpoints and benchmarks; counters are totals since start."""
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float          # fraction of pages held by a sequence (cached-free pages count as free)
    num_preemptions: int
    prompt_tokens: int             # prompt tokens computed (prefix-cache hits not counted)
    generation_tokens: int         # tokens sampled


class Engine:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, runner: ModelRunner, tokenizer=None):
        self.cfg, self.model_cfg, self.runner = cfg, model_cfg, runner
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.eos_ids = list(model_cfg.eos_token_ids)
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming the bad parameter. A rejected
        request leaves the engine and every accepted request untouched."""
        params = params if params is not None else SamplingParams()
        params.validate(max_n=min(self.cfg.max_n, self.cfg.max_num_seqs))
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req = Request(request_id, text, token_ids, params, max_tokens)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        for j in range(params.n):
            seq = Sequence(next(self._ids), req, j, list(token_ids), len(token_ids),
                           seed=_sample_seed(base_seed, j),
                           status=SeqStatus.WAITING if j == 0 else SeqStatus.UNBORN,
                           logprobs=[] if params.logprobs is not None else None,
                           prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs and j == 0 else None)
            if self.detokenizer is not None:
                seq.detokenizer = self.detokenizer.stream(params.skip_special_tokens)
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
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

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len, n_prompt = self.cfg.max_model_len, len(token_ids)
        if n_prompt >= max_len:
            raise ValueError(f"prompt: {n_prompt} tokens leave no room for output within max_model_len={max_len}")
        room = max_len - n_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"max_tokens: {max_tokens} exceeds the {room} tokens left in the context "
                             f"(max_model_len={max_len}, prompt={n_prompt})")
        pages = self.block_manager.pages_for(n_prompt + max_tokens)
        if pages > self.cfg.num_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens = {n_prompt + max_tokens} tokens need {pages} KV pages, "
                             f"but the cache holds {self.cfg.num_blocks}")
        return max_tokens

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort_request(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_blocks,
                           bm.num_free_blocks, bm.usage(), self.scheduler.num_preemptions,
                           self.prompt_tokens_computed, self.generation_tokens)

    # -- the step loop ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step; returns an output for every request that got a token (cumulative text and
        ids, for streaming), or with finished_only only for requests that finished: building
        outputs copies each request's lists, which offline callers need not pay every step."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_work() and not self.scheduler.running:
                # admission checks make this unreachable; fail loudly rather than spin
                raise RuntimeError("scheduler: waiting requests but nothing can be scheduled")
            return []
        now = time.monotonic()
        for item in sched.scheduled:
            req = item.seq.request
            req.first_scheduled_time = req.first_scheduled_time or now
            if item.seq.num_computed_tokens < item.seq.num_prompt_tokens:
                self.prompt_tokens_computed += min(item.num_new_tokens,
                                                   item.seq.num_prompt_tokens - item.seq.num_computed_tokens)
        fwd = self.runner.execute(sched)                   # logits: one row per sequence that samples
        for seq, positions, values in fwd.prompt_logprobs:
            for p, v in zip(positions, values):
                seq.prompt_logprobs[p] = v
        sampling = [item.seq for item in sched.scheduled if item.samples]
        self._advance(sched)
        seqs, rows = self._fork_samples(sampling)
        tokens, info = self.runner.sample(fwd.logits[rows], seqs, self.eos_ids)
        return self._update(seqs, tokens.tolist(), info, finished_only)

    def _advance(self, sched: SchedulerOutput) -> None:
        """The step's tokens are now in the cache: count them, and offer newly full pages."""
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_full_pages(item.seq)

    def _fork_samples(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Which sequence each sampled token goes to. A request's first sample forks its other
        samples here: they share the prompt's pages and draw from the same logits row."""
        seqs, rows = [], []
        for row, seq in enumerate(sampling):
            seqs.append(seq)
            rows.append(row)
            if seq.sample_index == 0 and seq.num_output_tokens == 0:
                for child in seq.request.seqs[1:]:
                    if child.status == SeqStatus.UNBORN:
                        self.block_manager.fork(seq, child)
                        self.scheduler.add_forked(child)
                        seqs.append(child)
                        rows.append(row)
        return seqs, rows

    def _update(self, seqs: list[Sequence], tokens: list[int], info, finished_only: bool) -> list[RequestOutput]:
        touched = {}
        now = time.monotonic()
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            req = seq.request
            req.first_token_time = req.first_token_time or now
            seq.token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(self._logprob_entry(info, i, tok, req.params.logprobs))
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            touched[req.request_id] = req
        self.generation_tokens += len(tokens)
        for req in touched.values():
            if req.is_finished:
                req.finished_time = now
                self.requests.pop(req.request_id, None)
        return [RequestOutput.of(r) for r in touched.values() if not finished_only or r.is_finished]

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        params = seq.request.params
        if tok in (params.stop_token_ids or []) or (not params.ignore_eos and tok in self.eos_ids):
            return "stop"     # min_tokens is enforced by banning these tokens until then
        if seq.detokenizer is not None:
            before = len(seq.text)
            seq.text += self.detokenizer.step(seq.detokenizer, tok)
            if params.stop_strings and seq.num_output_tokens >= params.min_tokens:
                # a stop string can only end inside the new piece: search from just before it
                start = max(0, before - max(map(len, params.stop_strings)) + 1)
                hits = [i for s in params.stop_strings if (i := seq.text.find(s, start)) >= 0]
                if hits:
                    seq.text = seq.text[:min(hits)]
                    return "stop"
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _logprob_entry(self, info, i: int, tok: int, k: int) -> dict[int, Logprob]:
        chosen, rank, top_v, top_i = info
        decode = self.detokenizer.token_text if self.detokenizer is not None else (lambda t: None)
        entry = {tok: Logprob(float(chosen[i]), int(rank[i]), decode(tok))}
        if k:
            for r, (t, v) in enumerate(zip(top_i[i, :k].tolist(), top_v[i, :k].tolist()), start=1):
                entry.setdefault(t, Logprob(v, r, decode(t)))
        return entry


def _sample_seed(base: int, index: int) -> int:
    """Sample j of a request draws from its own stream; sample 0 uses the request's seed itself."""
    return base if index == 0 else random.Random(base * 1_000_003 + index).getrandbits(63)
