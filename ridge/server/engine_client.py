"""The engine thread and its asyncio front end.

The engine is not thread safe, so one thread owns it and runs the step loop. Prompts are
tokenized (and chat templates rendered) before they reach it, in a small pool of worker
threads, so a megabyte prompt costs its own request time, not every stream's next token (the
encoder releases the GIL; ridge.engine.prompts). HTTP handlers never touch the engine: they put
commands (add, abort) on a thread-safe queue and get results back through `loop.call_soon_threadsafe`, one call per
engine step carrying every output of that step. Requests join the running batch at the next
step boundary (continuous batching across HTTP requests). With nothing to run, the thread
blocks on the queue, so an idle server burns no CPU.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ridge.engine.engine import EngineStats
from ridge.engine.faults import StepFault
from ridge.engine.prompts import TokenizedPrompt
from ridge.engine.request import RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.parallel import RankFailure
from ridge.server.engine_errors import EngineFailure, EngineUnavailable, ServerShutdown
from ridge.server.prompt_work import ChatPrompt, encode_in_worker

__all__ = ["ChatPrompt", "EngineClient", "EngineFailure", "EngineItem", "EngineUnavailable", "ModelInfo",
           "ServerShutdown"]

log = logging.getLogger("ridge.server")

LOADING, READY, DEAD, STOPPED = "loading", "ready", "dead", "stopped"


@dataclass
class EngineItem:
    """What the engine thread hands one request after a step: its cumulative output, or the
    error that ended it. `time` is when the step's results were handed out (monotonic)."""
    request_id: str
    output: RequestOutput | None
    time: float
    error: str | None = None
    stopped: bool = False       # the error is the server's shutdown, not a failure

    def failure(self) -> EngineFailure:
        return (ServerShutdown if self.stopped else EngineFailure)(self.error)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | TokenizedPrompt
    params: SamplingParams
    sink: asyncio.Queue
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Failed:
    """A tensor-parallel rank failed (said by the engine's watcher thread, at once, even while
    the engine is idle)."""
    message: str


_STOP = object()


@dataclass
class ModelInfo:
    path: str
    max_model_len: int
    vocab_size: int
    max_n: int                  # samples one request may ask for


@dataclass
class EngineClient:
    """Start with `start()` from the event loop. `add` queues a request (raising ValueError for
    a bad one, EngineUnavailable when not ready); its outputs arrive as EngineItems on `sink`."""
    factory: Callable[[], object]                  # builds the LLM, in the engine thread
    tokenizer_workers: int = 2
    state: str = LOADING
    error: str | None = None
    stats: EngineStats | None = None
    model: ModelInfo | None = None
    _commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _sinks: dict = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _llm: object = None
    _pool: ThreadPoolExecutor | None = None
    _closing: bool = False
    on_load_failure: Callable[[], None] | None = None   # called in the engine thread
    on_device_lost: Callable[[], None] | None = None    # likewise, after a fatal StepFault
    device_lost: bool = False

    # -- front end (event-loop thread) ---------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self.tokenizer_workers, thread_name_prefix="ridge-tokenize")
        self._thread = threading.Thread(target=self._run, name="ridge-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Call from the event loop: closing first means no add can queue behind the stop
        command (an add checks and queues with no await in between)."""
        self._closing = True
        self._commands.put(_STOP)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():   # the closed LLM goes (routes, kept by FastAPI's caches, hold this)
                self._llm = None

    async def drain(self, timeout: float, cut_short: Callable[[], bool] = lambda: False) -> None:
        """Graceful shutdown, from the event loop: admit nothing more (adds and /health answer
        503 from now on), let the requests in flight run for up to `timeout` seconds (or until
        `cut_short()`), then stop the engine, which ends each request still running with the
        error "the server is shutting down" (a stream's last event, then its [DONE])."""
        self._closing = True
        deadline = time.monotonic() + timeout

        def busy() -> bool:         # read from the loop thread: a dict's and a queue's size are atomic
            return self.state == READY and (bool(self._sinks) or not self._commands.empty())

        if busy():
            log.info("shutting down: draining %d request(s) for up to %g s", len(self._sinks), timeout)
        while busy() and time.monotonic() < deadline and not cut_short():
            await asyncio.sleep(0.05)
        if busy():
            log.warning("shutting down: ending %d request(s) still running", len(self._sinks))
        self._commands.put(_STOP)

    @property
    def ready(self) -> bool:
        return self.state == READY and not self._closing

    def check_ready(self) -> None:
        if self._closing:
            raise EngineUnavailable("the server is shutting down")
        if self.state == LOADING:
            raise EngineUnavailable("the engine is still loading the model")
        if self.state != READY:
            raise EngineUnavailable(self.error or f"the engine is not running ({self.state})")

    async def add(self, request_id: str, prompt, params: SamplingParams, sink: asyncio.Queue,
                  parse_special_tokens: bool = False) -> None:
        self.check_ready()
        if isinstance(prompt, (str, ChatPrompt)) and self._llm.encoder is not None:
            prompt = await encode_in_worker(self._loop, self._pool, self._llm.encoder, prompt, parse_special_tokens)
            self.check_ready()          # the server may have begun to close meanwhile
        elif isinstance(prompt, ChatPrompt):
            raise ValueError("messages: this model has no tokenizer")
        if params.structured_outputs is not None:   # compiled off the engine thread (then cached)
            await self._loop.run_in_executor(self._pool, self._llm.engine.intake.compile_grammar, params)
            self.check_ready()
        accepted = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, sink, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)      # queued after the add, so it finds the request
            raise

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def token_texts(self, ids: list[int]) -> list[tuple[str | None, bytes | None]]:
        """Each id's name and bytes (ridge.engine.token_text), as the engine names logprobs."""
        texts = self._llm.token_texts
        return [texts(t) for t in ids]

    async def run_in_worker(self, fn, *args):
        """`fn(*args)` in a tokenizer worker thread (work that grows with a request's bytes)."""
        return await self._loop.run_in_executor(self._pool, fn, *args)

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._llm = self.factory()
            cfg = self._llm.engine.cfg
            self.model = ModelInfo(cfg.model, cfg.max_model_len, self._llm.engine.model_cfg.vocab_size,
                                   min(cfg.max_n, cfg.max_num_seqs))
            self.stats = self._llm.engine.stats()
            self._llm.on_failure(lambda message: self._commands.put(_Failed(message)))
            # What loading made (the model, the tokenizer, transformers' and torch's modules:
            # some 400k objects) lives as long as the process; a full collection would walk it all
            # (~0.3 s with the GIL held: every stream stalls) each time the young objects of
            # serving trigger one. Frozen, collections walk only what serving allocates.
            gc.collect()
            gc.freeze()
        except BaseException as e:      # noqa: BLE001 - any load failure leaves a dead engine
            log.exception("engine failed to load")
            self._fail_all(DEAD, f"the engine failed to load: {type(e).__name__}")
            if self.on_load_failure is not None:
                self.on_load_failure()
        else:
            self.state = READY
            log.info("engine ready: %s", self.model.path)
            self._serve()
        finally:
            if self._llm is not None:
                try:
                    self._llm.close()   # a tensor-parallel engine's workers stop now, not at exit
                except Exception:       # noqa: BLE001 - a lost device may refuse its own teardown
                    log.exception("engine teardown failed")
            # frozen objects are never collected, not even at exit: the cycles loading made would
            # outlive the interpreter, and Triton's bindings (nanobind) print each as a leak
            gc.unfreeze()
        self._refuse_until_stopped()

    def _serve(self) -> None:
        engine = self._llm.engine
        while self.state == READY:
            for cmd in self._take_commands(block=not engine.has_unfinished()):
                if cmd is _STOP:
                    self._fail_all(STOPPED, "the server is shutting down")
                    return
                if isinstance(cmd, _Failed):
                    if self.state == READY:
                        log.error("engine failed: %s", cmd.message)
                        self._fail_all(DEAD, f"the engine failed: {cmd.message}")
                elif self.state == READY:
                    self._handle(cmd)
                elif isinstance(cmd, _Add):
                    self._resolve(cmd.accepted, EngineUnavailable(self.error))
            if self.state == READY and engine.has_unfinished():
                self._step()
            self.stats = engine.stats()

    def _refuse_until_stopped(self) -> None:
        """A dead engine keeps answering: adds raced past the front end's state check get
        EngineUnavailable (503) instead of waiting forever."""
        while self.state != STOPPED:
            cmd = self._commands.get()
            if cmd is _STOP:
                self.state = STOPPED
            elif isinstance(cmd, _Add):
                self._resolve(cmd.accepted, EngineUnavailable(self.error or "the engine is not running"))

    def _take_commands(self, block: bool) -> list:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd) -> None:
        engine = self._llm.engine
        if isinstance(cmd, _Abort):
            if self._sinks.pop(cmd.request_id, None) is not None:
                engine.abort(cmd.request_id)
            return
        try:
            engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
        except ValueError as e:
            self._resolve(cmd.accepted, e)
            return
        except Exception as e:          # noqa: BLE001 - this request fails, not the server
            log.exception("could not add request %s", cmd.request_id)
            self._resolve(cmd.accepted, EngineFailure(f"the request could not be queued ({type(e).__name__})"))
            return
        self._sinks[cmd.request_id] = cmd.sink
        self._resolve(cmd.accepted, None)

    def _step(self) -> None:
        engine = self._llm.engine
        try:
            outs = engine.step()
        except RankFailure as e:        # a tensor-parallel rank is gone: no step can run any more
            log.error("engine failed: %s", e)
            self._fail_all(DEAD, f"the engine failed: {e}")
            return
        except StepFault as e:
            log.error("%s", e, exc_info=e.__cause__)
            if e.fatal:
                return self._lose_device(e.reason)
            return self._fail(e.request_ids, f"the engine failed while running this request ({e.reason})")
        except Exception as e:          # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed")
            self._recover(f"the engine failed while running this request ({type(e).__name__})")
            return
        now = time.monotonic()
        batch = []
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            batch.append((sink, EngineItem(out.request_id, out, now)))
        self._deliver(batch)

    def _recover(self, message: str) -> None:
        """A step failed outside the engine's fault handling (no StepFault): fail every request in
        flight, which returns all their pages; a pool not then entirely free means broken
        bookkeeping, and the engine is declared dead (503 from then on)."""
        engine, request_ids = self._llm.engine, list(self._sinks)
        try:
            for rid in request_ids:
                engine.abort(rid)
            st = engine.stats()
            healthy = not engine.has_unfinished() and st.num_free_pages == st.num_pages
        except Exception:               # noqa: BLE001
            log.exception("engine recovery failed")
            healthy = False
        self._fail(request_ids, message)
        if not healthy:
            self._fail_all(DEAD, "the engine failed and could not recover")

    def _fail(self, request_ids: list[str], message: str, stopped: bool = False) -> None:
        # end these requests (their pages already freed) with `message`
        now = time.monotonic()
        self._deliver([(self._sinks.pop(rid), EngineItem(rid, None, now, error=message, stopped=stopped))
                       for rid in request_ids if rid in self._sinks])

    def _lose_device(self, reason: str) -> None:
        """A CUDA context error: every request ends, /health fails, the process exits (status 1)."""
        self.device_lost = True
        self._fail_all(DEAD, f"the engine lost its device ({reason}); the server is exiting")
        if self.on_device_lost is not None:
            self.on_device_lost()

    def _fail_all(self, state: str, message: str) -> None:
        self.state, self.error = state, message
        self._fail(list(self._sinks), message, stopped=state == STOPPED)

    def _deliver(self, batch: list) -> None:
        if batch:
            self._call_soon(_put_all, batch)

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None) -> None:
        self._call_soon(settle, fut, exc)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:            # the loop has closed: nobody is waiting any more
            pass


def _put_all(batch) -> None:
    for sink, item in batch:
        sink.put_nowait(item)


def settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():                      # the handler gave up waiting (client gone)
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
