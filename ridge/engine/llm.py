"""`LLM`: the offline Python API (the shape vLLM users know)."""
from __future__ import annotations

import gc
import inspect
import os
import weakref
from typing import Callable

import torch
from tqdm.auto import tqdm

from ridge.config import EngineConfig
from ridge.engine.engine import Engine
from ridge.engine.intake import prompt_list, sampling_list
from ridge.engine.prompts import TokenizedPrompt
from ridge.engine.request import RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.spec.speculator import build_speculator
from ridge.runner.model_runner import ModelRunner
from ridge.parallel import launched
from ridge.runner.workers import WorkerPool, serve_launched
from ridge.settings import fields as setting_fields
from ridge.utils import trace


def release_devices(workers, runners: list, engines: list, tracer=None) -> None:
    """Give back what an LLM holds on its devices: the tensor-parallel workers stop (rank 0's CUDA
    graphs go before it leaves the group), the engine drops its own device state (Engine.release),
    each runner drops its graphs, KV pool and model, then whatever only reference cycles still held
    is collected and the caching allocator's free blocks go back to the driver, so the next engine
    in this process finds the memory free. The trace (trace_dir), if one was kept, is closed."""
    trace.stop(tracer)
    if workers is not None:
        workers.close()
    for engine in engines:
        engine.release()
    for runner in runners:
        runner.close()
    gc.collect()
    if any(r.device.type == "cuda" for r in runners):
        torch.cuda.empty_cache()


def load_tokenizer(path: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLM:
    """The offline engine. `LLM(model, **settings)` takes exactly the fields of
    `ridge.config.EngineConfig` (see `ridge.settings.describe(EngineConfig)`); every value is
    checked before anything is loaded and a bad one raises ValueError naming it. Under torchrun
    (distributed_executor_backend="external_launcher") only rank 0 gets an LLM: on the other
    ranks the constructor serves rank 0's steps and then exits the process (SystemExit(0))."""

    def __init__(self, model: str | None = None, *, show_progress: bool = True, **settings):
        if not isinstance(show_progress, bool):
            raise ValueError(f"show_progress: must be true or false, got {show_progress!r}")
        cfg, model_cfg = EngineConfig.from_kwargs(model=model, **settings).resolve()
        if cfg.tensor_parallel_size > 1 and cfg.distributed_executor_backend == "external_launcher" \
                and launched().rank > 0:
            serve_launched(cfg, model_cfg)          # a torchrun rank > 0 serves rank 0's engine, then its job ends
            raise SystemExit(0)
        tracer = trace.start(cfg.trace_dir) if cfg.trace_dir else None     # the load is traced too
        # tensor parallelism: ranks 1.. start (and load their shares) while this process loads its own
        workers = None
        try:
            workers = WorkerPool(cfg, model_cfg) if cfg.tensor_parallel_size > 1 else None
            with trace.span("load model"):
                runner = ModelRunner(cfg, model_cfg, show_progress=show_progress, workers=workers)
            speculator, draft_runner = build_speculator(cfg, model_cfg, runner, show_progress)
            # a draft model's pool holds as many pages as the target's: the budget pays for both
            cfg.num_pages = runner.pages_fitting(draft_runner.kv_bytes_per_page() if draft_runner else 0)
            if cfg.num_pages < 1:
                name = "gpu_memory_utilization" if cfg.gpu_memory_utilization is not None else "kv_cache_memory"
                raise ValueError(f"{name}: too small to hold a single KV page")
            verify = (cfg.speculation.num_speculative_tokens + 1, min(cfg.max_num_seqs, speculator.cutoff)) \
                if speculator is not None else ()
            with trace.span("start: KV pool, CUDA graphs"):
                runner.start(cfg.num_pages, not cfg.enforce_eager, *verify)   # verify steps replay graphs of their own
            if draft_runner is not None:
                speculator.proposer.allocate(cfg.num_pages, use_graphs=not cfg.enforce_eager)
        except BaseException:
            trace.stop(tracer)
            if workers is not None:
                workers.close()
            raise
        # the devices are given back (the workers stop, the ring's segment goes) when the LLM is closed or
        # collected, or at exit; the finaliser holds the runners, not the LLM
        self._workers, engines = workers, []
        self._close = weakref.finalize(self, release_devices, workers, [r for r in (runner, draft_runner) if r],
                                       engines, tracer)
        self.engine = Engine(cfg, model_cfg, runner, load_tokenizer(cfg.model), speculator)
        engines.append(self.engine)     # the engine holds no reference back to the LLM: no cycle
        self.tokenizer, self.show_progress = self.engine.tokenizer, show_progress   # use_tqdm's default
        self.encoder = self.engine.intake.encoder       # text -> ids, thread safe (None: no tokenizer)
        # id -> (the text it contributes, its bytes), as logprobs name tokens; thread safe (a cache of pure results)
        self.token_texts = self.engine.committer.token_texts

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable | None = None, *,
                 parse_special_tokens: bool = False) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids, or a list of those); all the
        call's requests are accepted or none is, a call that fails or is interrupted (Ctrl-C) aborts
        what it admitted, and requests already in the engine are untouched. Special-token strings
        in a text prompt (`<|eot_id|>`) are plain text unless `parse_special_tokens=True`.
        `use_tqdm`: a progress bar over the requests, or (as in vLLM) a callable that makes one from
        `total=`, e.g. `functools.partial(tqdm, desc="scoring")`."""
        if not isinstance(parse_special_tokens, bool):
            raise ValueError(f"parse_special_tokens: must be true or false, got {parse_special_tokens!r}")
        self._check_open()
        prompts = prompt_list(prompts)
        sampling_params = sampling_list(sampling_params, len(prompts))
        if parse_special_tokens and self.encoder is not None:
            prompts = [TokenizedPrompt(p, self.encoder.encode(p, parse_special_tokens=True)) if isinstance(p, str)
                       else p for p in prompts]
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params))
            return self._run(ids, self.show_progress if use_tqdm is None else use_tqdm)
        except BaseException:
            for rid in ids:                   # all or nothing: their pages go back to the pool
                self.engine.abort(rid)
            raise

    def close(self) -> None:
        """Give back the engine's device memory (CUDA graphs, KV pool, weights) and stop a
        tensor-parallel engine's worker processes and remove its shared memory; also done when the
        LLM is garbage-collected or the interpreter exits, and at the end of a `with` block.
        Idempotent; a closed LLM refuses to generate."""
        self._close()

    def _check_open(self) -> None:
        if not self._close.alive:
            raise RuntimeError("LLM: this engine is closed (close() or its `with` block gave its device memory "
                               "back); build a new LLM to generate")

    def on_failure(self, callback) -> None:
        """Have `callback(message)` called, from another thread, as soon as a tensor-parallel rank
        dies (the message names it and why); the engine's next step raises RankFailure. One rank:
        never called."""
        if self._workers is not None:
            self._workers.on_failure.append(callback)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (an unknown or finished id is ignored, as in vLLM)."""
        self._check_open()
        self.engine.abort(request_id)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool | None = None, *, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Reply to a conversation (a list of {"role", "content"} messages) or to each of a list of them.
        `tools` (OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}], as
        vLLM's LLM.chat takes them) go to the chat template, which lists them to the model; assistant
        messages may carry `tool_calls` and `tool` messages the results. What the model writes is
        returned as text: hold it to a call with SamplingParams.structured_outputs."""
        self._check_open()
        if self.encoder is None:
            raise ValueError("messages: this checkpoint has no tokenizer")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: expected a non-empty list of {'role', 'content'} messages "
                             "(or a list of such lists)")
        conversations = messages if all(isinstance(m, (list, tuple)) for m in messages) else [messages]
        sampling_list(sampling_params, len(conversations))
        prompts = [self.encoder.chat(conv, tools) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool | Callable) -> list[RequestOutput]:
        pending, done = set(ids), {}
        bar = use_tqdm(total=len(ids)) if callable(use_tqdm) else \
            tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        with bar:
            while pending:
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]


# LLM(model=None, *, <every EngineConfig setting>, show_progress=True), for help() and editors
_P = inspect.Parameter
LLM.__init__.__signature__ = inspect.Signature([
    _P("self", _P.POSITIONAL_OR_KEYWORD), _P("model", _P.POSITIONAL_OR_KEYWORD, default=None),
    *(_P(f.name, _P.KEYWORD_ONLY, default=f.default, annotation=f.type)
      for f, _, _ in setting_fields(EngineConfig) if f.name != "model"),
    _P("show_progress", _P.KEYWORD_ONLY, default=True, annotation="bool")])
