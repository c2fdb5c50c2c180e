"""The engine: validates and queues requests, and runs the step loop.

    step = schedule -> prepare + forward (runner) -> sample -> update

Everything a step calls lives in its own module; this file only wires them together.

Overlapped decode. Reading a step's sampled ids back makes the host wait for the GPU, and the
next step's host work (scheduling, batch building, launching) then leaves the GPU idle. When a
decode step needs nothing from the host but its ids (no log-probabilities, no penalties), the
engine leaves its ids on the GPU (placeholders in the host's token lists, `num_pending`), and
on the next call first schedules and launches the following decode step, whose input ids are
gathered on the device, and only then waits for the earlier ids and commits them. A sequence
that the earlier token finishes (a stop token) has had one extra token computed; it is
discarded. Sequences the earlier token finishes by length are known in advance and left out.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import torch

from ridge.config import EngineConfig, ModelConfig
from ridge.engine.pages import PageAllocator
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
    num_pages: int
    num_free_pages: int
    kv_cache_usage: float          # fraction of pages held by a sequence (cached-free pages count as free)
    num_preemptions: int
    prompt_tokens: int             # prompt tokens computed (prefix-cache hits not counted)
    generation_tokens: int         # tokens sampled


class Engine:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, runner: ModelRunner, tokenizer=None):
        self.cfg, self.model_cfg, self.runner = cfg, model_cfg, runner
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.pages = PageAllocator(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pages, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.eos_ids = list(model_cfg.eos_token_ids)
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.inflight: InflightStep | None = None
        self.overlapped_steps = 0      # decode steps launched before the previous step's ids were read

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
        pages = self.pages.pages_for(n_prompt + max_tokens)
        if pages > self.cfg.num_pages:
            raise ValueError(f"max_tokens: prompt + max_tokens = {n_prompt + max_tokens} tokens need {pages} KV pages, "
                             f"but the cache holds {self.cfg.num_pages}")
        return max_tokens

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort_request(req)
        if self.inflight is not None and all(s.is_finished for s in self.inflight.seqs):
            self.inflight = None                 # nothing left to commit

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def stats(self) -> EngineStats:
        bm = self.pages
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_pages,
                           bm.num_free_pages, bm.usage(), self.scheduler.num_preemptions,
                           self.prompt_tokens_computed, self.generation_tokens)

    # -- the step loop ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step; returns an output for every request that got a token (cumulative text and
        ids, for streaming), or with finished_only only for requests that finished: building
        outputs copies each request's lists, which offline callers need not pay every step."""
        if self.inflight is not None:
            return self._step_overlapped(finished_only)
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
        if fwd.static_decode and self.cfg.async_scheduling and len(seqs) == len(sampling) \
                and all(_overlappable(s.request.params) for s in seqs):
            self.inflight = self._leave_on_device(seqs, tokens, sched)
            return []
        return self._update(seqs, tokens.tolist(), info, finished_only)

    def _step_overlapped(self, finished_only: bool) -> list[RequestOutput]:
        """Launch the next decode step if it can be decided now, then commit the in-flight
        step's ids (the wait for them overlaps the step just launched)."""
        prev = self.inflight
        ahead = self._launch_ahead(prev)
        self.inflight = None
        outputs = self._update(prev.seqs, self.runner.host_tokens(prev.host, prev.done), None, finished_only,
                               prev.indices)
        if ahead is not None:
            self.overlapped_steps += 1
            ahead.sched.scheduled = [i for i in ahead.sched.scheduled if not i.seq.is_finished]
            self._advance(ahead.sched)      # its input tokens are known now: full pages can be hashed
            self.inflight = ahead
        return outputs

    def _launch_ahead(self, prev: InflightStep) -> InflightStep | None:
        """The decode step after `prev`, launched before prev's ids are on the host: only when
        prev's sequences are all that runs and nothing waits (admissions and preemptions need the
        regular schedule), and without the sequences prev's token ends by length."""
        live = [s for s in prev.seqs if s.status == SeqStatus.RUNNING]
        if self.scheduler.waiting or not live or len(live) != len(self.scheduler.running):
            return None
        max_len = self.cfg.max_model_len
        seqs = [s for s in live if s.num_output_tokens < s.request.max_tokens and s.num_tokens < max_len]
        sched = self.scheduler.schedule_decode(seqs) if seqs else None
        if sched is None:
            return None
        row = {s.seq_id: i for i, s in enumerate(prev.seqs)}
        fwd = self.runner.execute(sched, (prev.tokens, [row[s.seq_id] for s in seqs]))
        tokens, _ = self.runner.sample(fwd.logits, seqs, self.eos_ids)
        return self._leave_on_device(seqs, tokens, sched)

    def _leave_on_device(self, seqs: list[Sequence], tokens: torch.Tensor, sched: SchedulerOutput) -> InflightStep:
        host, done = self.runner.tokens_to_host(tokens)
        indices = []
        for seq in seqs:
            indices.append(len(seq.token_ids))
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
        return InflightStep(seqs, tokens, host, done, indices, sched)

    def _advance(self, sched: SchedulerOutput) -> None:
        """The step's tokens are now in the cache: count them, and offer newly full pages."""
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.pages.register_full_pages(item.seq)

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
                        self.pages.fork(seq, child)
                        self.scheduler.add_forked(child)
                        seqs.append(child)
                        rows.append(row)
        return seqs, rows

    def _update(self, seqs: list[Sequence], tokens: list[int], info, finished_only: bool,
                indices: list[int] | None = None) -> list[RequestOutput]:
        """Commit sampled tokens: appended, or with `indices` written over the placeholders at
        those positions (an overlapped step; a sequence finished meanwhile is skipped)."""
        touched = {}
        now = time.monotonic()
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            req = seq.request
            if indices is None:
                seq.token_ids.append(tok)
                length = len(seq.token_ids)
            else:
                if seq.is_finished:
                    continue
                seq.token_ids[indices[i]] = tok
                seq.num_pending -= 1
                length = indices[i] + 1
            req.first_token_time = req.first_token_time or now
            if seq.logprobs is not None:
                seq.logprobs.append(self._logprob_entry(info, i, tok, req.params.logprobs))
            reason = self._finish_reason(seq, tok, length)
            if reason is not None:
                del seq.token_ids[length:]          # a later step's placeholder, if one was launched
                seq.num_pending = 0
                self.scheduler.finish(seq, reason)
            touched[req.request_id] = req
            self.generation_tokens += 1
        for req in touched.values():
            if req.is_finished:
                req.finished_time = now
                self.requests.pop(req.request_id, None)
        return [RequestOutput.of(r) for r in touched.values() if not finished_only or r.is_finished]

    def _finish_reason(self, seq: Sequence, tok: int, length: int) -> str | None:
        """Why `tok`, the sequence's token number `length`, ends it (None: it does not)."""
        params = seq.request.params
        num_output = length - seq.num_prompt_tokens
        if tok in (params.stop_token_ids or []) or (not params.ignore_eos and tok in self.eos_ids):
            return "stop"     # min_tokens is enforced by banning these tokens until then
        if seq.detokenizer is not None:
            before = len(seq.text)
            seq.text += self.detokenizer.step(seq.detokenizer, tok)
            if params.stop_strings and num_output >= params.min_tokens:
                # a stop string can only end inside the new piece: search from just before it
                start = max(0, before - max(map(len, params.stop_strings)) + 1)
                hits = [i for s in params.stop_strings if (i := seq.text.find(s, start)) >= 0]
                if hits:
                    seq.text = seq.text[:min(hits)]
                    return "stop"
        if num_output >= seq.request.max_tokens or length >= self.cfg.max_model_len:
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


PENDING = -1    # a token id still on the GPU


@dataclass
class InflightStep:
    """A decode step whose sampled ids have not been read back yet."""
    seqs: list[Sequence]              # one per sampled row
    tokens: torch.Tensor              # [rows] int64 on the device: the next step's inputs
    host: torch.Tensor                # their host copy, valid once `done` has completed
    done: object                      # torch.cuda.Event, or None where the copy is synchronous
    indices: list[int]                # the token_ids index each row's id fills
    sched: SchedulerOutput            # advanced (pages registered) once the ids before it are known


def _overlappable(params: SamplingParams) -> bool:
    """Sampling that needs no host-side token history or per-token results."""
    return params.logprobs is None and not params.uses_penalties


def _sample_seed(base: int, index: int) -> int:
    """Sample j of a request draws from its own stream; sample 0 uses the request's seed itself."""
    return base if index == 0 else random.Random(base * 1_000_003 + index).getrandbits(63)
