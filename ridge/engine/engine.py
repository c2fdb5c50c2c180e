"""The engine: queues requests and runs the step loop,

    step = schedule -> prepare + forward (runner) -> sample -> commit

wiring together modules of their own: intake (validation, tokenization), scheduler and pages
(who runs, where their KV lives), the runner, commit (tokens, stops, logprobs), overlap (decode
steps launched before the previous step's ids are read back) and spec (speculative decoding: one
call a step, around it; its verification is the sampling of the rows with drafts)."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ridge.config import EngineConfig, ModelConfig
from ridge.engine.commit import Committer
from ridge.engine.faults import StepFault, check_finite, end_touched, readback_ids
from ridge.engine.intake import Intake
from ridge.engine.kv_events import KVEventPublisher
from ridge.engine.overlap import DecodeOverlap
from ridge.engine.pages import PageAllocator
from ridge.engine.request import Request, RequestOutput, acceptance_rate, mean_accepted_length
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.scheduler import Scheduler, SchedulerOutput
from ridge.engine.spec.speculator import SpecStep
from ridge.layers.sampler import info_on_host
from ridge.parallel import RankFailure
from ridge.utils import trace


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
    num_decode_steps: int          # steps served by the static decode path (CUDA graphs where captured)
    num_overlapped_steps: int      # of which launched before the previous step's ids were read back
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission,
    prefix_cache_hits: int = 0     # and of those found cached (not computed)
    spec_num_drafts: int = 0       # speculative decoding: a sequence's verify steps with drafts,
    spec_num_draft_tokens: int = 0  # the draft tokens proposed,
    spec_num_accepted_tokens: int = 0  # and of those accepted,
    spec_accepted_per_pos: tuple = ()  # [i]: verify steps that accepted draft i (vLLM's per_pos)
    spec_propose_seconds: float = 0.0  # host time in the proposer (its draft cost)
    spec_method: str = ""              # the proposer
    spec_acceptance_rate = property(lambda self: acceptance_rate(self.spec_num_accepted_tokens,
                                                                 self.spec_num_draft_tokens))
    spec_mean_accepted_length = property(lambda self: mean_accepted_length(self.spec_num_accepted_tokens,
                                                                           self.spec_num_drafts))
    overlap_fraction = property(lambda self: self.num_overlapped_steps / self.num_decode_steps
                                if self.num_decode_steps else None)


class Engine:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, runner, tokenizer=None, speculator=None):
        self.cfg, self.model_cfg, self.runner, self.tokenizer = cfg, model_cfg, runner, tokenizer
        self.speculator = speculator                # ridge/engine/spec/speculator.py, or None
        self.eos_ids = list(model_cfg.eos_token_ids)
        publish = cfg.kv_events is not None and cfg.kv_events.enable_kv_cache_events
        self.pages = PageAllocator(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching, events=publish)
        # the prefix cache's page events for a KV-aware router (ridge/engine/kv_events.py)
        self.kv_events = KVEventPublisher(cfg.kv_events, cfg.page_size, "GPU" if runner.device.type == "cuda"
                                          else "CPU") if publish else None
        self.scheduler = Scheduler(self.pages, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.intake = Intake(cfg, model_cfg, tokenizer, self.pages.pages_for)
        self.committer = Committer(cfg.max_model_len, self.eos_ids, tokenizer, self.scheduler)
        self.overlap = DecodeOverlap(self.scheduler, runner, cfg.max_model_len, self._sample)
        if speculator is not None:
            speculator.attach(self.pages, self.intake.grammars)  # an EAGLE-3 head writes on the target's pages
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_computed = 0
        self.num_decode_steps = 0
        self.fault: str | None = None               # a step lost the device: no further step runs

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming the bad parameter. A rejected
        request leaves the engine and every accepted request untouched."""
        req = self.intake.make_request(prompt, params, request_id, self.requests)
        self.requests[req.request_id] = req
        self.scheduler.add(req.seqs[0])
        return req.request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort_request(req)
            trace.forget(request_id)
        self.overlap.drop_if_ended()

    def release(self) -> None:
        """Drop what the engine itself keeps on the device (LLM.close; the runners drop the rest):
        an overlapped step's ids, and the speculator with its proposer's per-sequence states."""
        self.overlap.inflight, self.speculator = None, None
        if self.kv_events is not None:
            self.kv_events.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.overlap.inflight is not None

    def stats(self) -> EngineStats:
        p = self.pages
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), p.num_pages,
                           p.num_free_pages, 1.0 - p.num_free_pages / p.num_pages, self.scheduler.num_preemptions,
                           self.prompt_tokens_computed, self.committer.generation_tokens,
                           self.num_decode_steps, self.overlap.num_overlapped_steps,
                           p.prefix_query_tokens, p.prefix_hit_tokens,
                           *(self.speculator.counters.totals() if self.speculator is not None else ()))

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step; returns an output for every request that got a token (cumulative text and
        ids, for streaming), or with finished_only only for requests that finished: building
        outputs copies each request's lists, which offline callers need not pay every step. With
        speculation the step runs inside its SpecStep (drafts planned first, the step timed). A
        step that fails ends the requests it touched and raises StepFault (ridge/engine/faults.py)."""
        if self.fault is not None:
            raise StepFault(f"the device was lost earlier: {self.fault}", [], fatal=True)
        try:
            spec = nullcontext() if self.speculator is None else \
                self.speculator.step(self.scheduler, self.committer, self.overlap.inflight is not None)
            with trace.span("step"), spec as turn:
                if self.overlap.inflight is not None:
                    return self._step_overlapped(turn, finished_only)
                return self._step(turn, finished_only)
        except RankFailure:
            raise                   # a tensor-parallel rank is gone: the pool's own failure, said as such
        except Exception as e:      # noqa: BLE001 - the step's requests fail, not the engine
            raise end_touched(self, e) from e
        finally:
            if self.kv_events is not None:
                self.kv_events.publish(self.pages.take_events())

    def _step(self, turn: SpecStep | None, finished_only: bool) -> list[RequestOutput]:
        with trace.span("schedule") as span:
            sched = self.scheduler.schedule()
            if trace.active() is not None:
                span.set(seqs=len(sched.scheduled), tokens=sum(i.num_new_tokens for i in sched.scheduled))
        if not sched.scheduled:
            if self.scheduler.has_work() and not self.scheduler.running:
                # admission checks make this unreachable; fail loudly rather than spin
                raise RuntimeError("scheduler: waiting requests but nothing can be scheduled")
            return []
        self._count_scheduled(sched)
        with trace.span("forward"):
            fwd = self.runner.execute(sched)               # logits: one row per sequence that samples
        for seq, start, targets, info in fwd.prompt_logprobs:
            self.committer.record_prompt_logprobs(seq, start, targets, info)
        items = [item for item in sched.scheduled if item.samples]
        self._advance(sched)
        decoding = len(items) == len(sched.scheduled) and all(i.num_new_tokens == 1 + i.num_draft for i in items)
        if any(item.num_draft for item in items):
            return self._outputs(self._commit_verified(turn.verify(items, fwd.logits, decoding), items, fwd.logits),
                                 finished_only)
        if turn is not None:
            turn.kind = "plain" if decoding else None
        sampling = [item.seq for item in items]
        seqs, rows = self.scheduler.fork_samples(sampling)
        with trace.span("sample"):
            tokens, info, ids = self._sample(fwd.logits[rows], seqs)
        self.num_decode_steps += fwd.static_decode
        if fwd.static_decode and self.cfg.async_scheduling and len(seqs) == len(sampling) \
                and not any(s.request.params.uses_penalties for s in seqs) \
                and (turn is None or not turn.keeps_drafting()):
            self.overlap.leave_on_device(seqs, tokens, info, ids, sched)
            return []
        return self._outputs(self.committer.commit(seqs, self._read_ids(ids, seqs), info_on_host(info)),
                             finished_only)

    def _commit_verified(self, verified, items: list, logits) -> list[Request]:
        """A step with drafts: items without drafts sample and fork as in a plain step, then each
        verified item commits its emitted run and keeps the cache of its accepted drafts."""
        seqs, rows = self.scheduler.fork_samples([i.seq for i in items if not i.num_draft])
        touched = []
        if rows:
            lasts = self.runner.to_device([verified.plain_rows[r] for r in rows], torch.int64)
            _, info, ids = self._sample(logits[lasts], seqs)
            touched = self.committer.commit(seqs, self._read_ids(ids, seqs), info_on_host(info))
        touched += self.committer.commit_runs([i.seq for i in verified.items], verified.tokens, verified.infos)
        for item, run in zip(verified.items, verified.tokens):
            self.scheduler.accept(item, len(run))
        return list({r.request_id: r for r in touched}.values())

    def _sample(self, logits: torch.Tensor, seqs: list):
        """Sample a row per sequence (`logits`: one row each, masked in place), structured outputs'
        masks applied first: (ids on the device, logprob info, the ids to read back: readback_ids)."""
        if self.intake.grammars is not None and self.intake.grammars.compiled:
            self.intake.grammars.mask(logits, seqs)
        tokens, info = self.runner.sample(logits, seqs, self.eos_ids)
        return tokens, info, readback_ids(logits, tokens, all(s.request.params.temperature == 0 for s in seqs))

    def _read_ids(self, ids: torch.Tensor, seqs: list, done=None) -> list[int]:
        with trace.span("read back"):               # on a GPU: the wait for the step's kernels
            host = self.runner.host_tokens(ids, done)
        check_finite(host, seqs)
        return host

    def _step_overlapped(self, turn: SpecStep | None, finished_only: bool) -> list[RequestOutput]:
        """Launch the next decode step if it can be decided now, then commit the in-flight
        step's ids (the wait for them overlaps the step just launched)."""
        unsampled = None
        if turn is not None and turn.drafts_next:
            prev, self.overlap.inflight = self.overlap.inflight, None   # commit it; the next step drafts
        else:
            with trace.span("launch ahead"):
                prev, unsampled = self.overlap.launch_ahead()
        if self.overlap.inflight is not None or unsampled is not None:
            self.num_decode_steps += 1
        tokens = self._read_ids(prev.host, prev.seqs, prev.done)
        outputs = self._outputs(self.committer.commit(prev.seqs, tokens, prev.info, prev.indices), finished_only)
        if unsampled is not None:
            self.overlap.sample_ahead(unsampled)        # the grammars have taken prev's ids: masks are current
        ahead = self.overlap.inflight
        if ahead is not None:
            ahead.sched.scheduled = [i for i in ahead.sched.scheduled if not i.seq.is_finished]
            self._advance(ahead.sched)      # its input tokens are known now: full pages can be hashed
        return outputs

    def _count_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            seq.request.first_scheduled_time = seq.request.first_scheduled_time or now
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens_computed += min(item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)

    def _advance(self, sched: SchedulerOutput) -> None:
        """The step's tokens are now in the cache: count them, and offer newly full pages. A
        sequence with drafts is advanced once its drafts are verified (Scheduler.accept)."""
        for item in sched.scheduled:
            if item.num_draft:
                continue
            item.seq.num_computed_tokens += item.num_new_tokens
            self.pages.register_full_pages(item.seq)

    def _outputs(self, touched: list[Request], finished_only: bool) -> list[RequestOutput]:
        trace.tokens(touched)
        for req in touched:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        return [RequestOutput.of(r) for r in touched if not finished_only or r.is_finished]

