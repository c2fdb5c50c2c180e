"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex, a choice
of strings or an EBNF grammar, through XGrammar (the grammar engine vLLM and SGLang serve these
with).

A grammar is compiled once against the tokenizer's vocabulary (XGrammar precomputes, per grammar
state, which tokens are allowed whatever follows them, so a step only walks the few tokens whose
validity depends on context) and cached by its text. Each sequence that asks for one carries a
matcher, its position in the grammar. Before a sampling step the engine fills one bit per
vocabulary entry for each such row (int32 words, vocab / 32 a row) and the disallowed logits go to
-inf in place, so every sampler path (greedy's argmax, top-k/p, logprobs) draws only tokens that
keep the output parseable (JSON without free whitespace between its tokens: vLLM's
disable_any_whitespace); when the token is committed the matcher advances, and a grammar that
has reached its end finishes the request ("stop"): the output is complete.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch


class StructuredOutputError(ValueError):
    """A structured output that names no kind or several, or that XGrammar cannot compile."""


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs` (SamplingParams): exactly one of a JSON schema (`json`, a dict or
    its JSON text), `json_object` (any JSON object), `regex`, `choice` (one of these strings) or
    `grammar` (EBNF, XGrammar's dialect of GBNF). ridge's `start_after`: the grammar holds the output
    only once this text has appeared in it (a reasoning model's `</think>`: the server sets it under a
    --reasoning-parser whose output opens in the reasoning, as vLLM waits for the reasoning to end);
    until then, and for the rest of the token that completes it, the output is free."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    start_after: str | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError("structured_outputs: give exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise StructuredOutputError(f"structured_outputs.start_after: a non-empty string, got {self.start_after!r}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except ValueError as e:
                    raise StructuredOutputError(f"structured_outputs.json: not valid JSON: {e}") from None
            elif not isinstance(self.json, dict):
                raise StructuredOutputError(f"structured_outputs.json: a JSON schema (object or its text), got {type(self.json).__name__}")
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError(f"structured_outputs.choice: a non-empty list of non-empty strings, got {self.choice!r}")
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputError(f"structured_outputs.json_object: must be true, got {self.json_object!r}")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise StructuredOutputError(f"structured_outputs.{kind}: a non-empty string, got {getattr(self, kind)!r}")

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError(f"structured_outputs: an object with one of json, json_object, regex, choice, "
                             f"grammar, got {type(value).__name__}")
        unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object", "start_after"}
        if unknown:
            raise StructuredOutputError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**value)

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached under."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


# From this many constrained rows a step the masks are filled by XGrammar's thread pool: one matcher
# after another costs ~25 us a row, the pool ~0.5 ms to wake plus ~4 us a row (docs/benchmarks/structured.md).
THREADED_FILL_ROWS = 32


class Grammars:
    """Compiles the grammars of one tokenizer (cached by their text), makes matchers for them, and
    puts their masks on logits: a decode step's (mask), a verify step's (mask_runs) and a draft
    model's (mask_matchers), all through one host bitmask kept across steps. XGrammar's tokenizer
    tables are made when the first grammar is compiled (an engine that never sees one never pays)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.xgr = self.compiler = None                  # made by the first compile
        self._made = threading.Lock()                    # a server compiles in worker threads
        self.compiled: dict[tuple[str, str], object] = {}
        self._bitmask: torch.Tensor | None = None       # see _host_bitmask
        self._copied = None                              # a CUDA event: the buffer's last copy has run
        self._threads = None                             # XGrammar's threaded fill, made when first needed

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, or a ValueError naming the field XGrammar could not compile."""
        key = params.key()
        found = self.compiled.get(key)
        if found is not None:
            return found
        kind, text = key
        with self._made:
            if self.compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self.xgr, self.compiler = xgr, xgr.GrammarCompiler(info)
        c = self.compiler
        try:
            if kind in ("json", "json_object"):
                # no free whitespace between tokens (XGrammar's separators ", " and ": "): a model that
                # favours newlines could otherwise spend every token on them and never close the object
                compiled = c.compile_json_schema(text if kind == "json" else '{"type": "object"}',
                                                 any_whitespace=False, strict_mode=True)
            elif kind == "choice":
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in params.choice))
            elif kind == "regex":
                compiled = c.compile_regex(text)
            else:
                compiled = c.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"structured_outputs.{kind}: XGrammar cannot compile it: {e}") from None
        self.compiled[key] = compiled
        return compiled

    def matcher(self, params: StructuredOutputsParams):
        compiled = self.compile(params)                 # first: it makes self.xgr
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, seqs: list) -> None:
        """Disallowed tokens' logits to -inf, in place, for each row whose sequence's grammar holds
        its next token (constrained); the other rows are left as they are."""
        self.mask_matchers(logits, [s.grammar if constrained(s) and not s.is_finished else None for s in seqs])

    def mask_matchers(self, logits: torch.Tensor, matchers: list) -> None:
        """Row i masked, in place, with matchers[i]'s current state (None: left alone); a draft
        model's step passes matchers that have walked the drafts drawn so far."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._host_bitmask(len(matchers), logits.is_cuda)
        if len(rows) < THREADED_FILL_ROWS:    # a row without a matcher is left as it is: `indices` skips it
            for i in rows:
                matchers[i].fill_next_token_bitmask(bitmask, i)
        else:
            if self._threads is None:
                self._threads = self.xgr.BatchGrammarMatcher()
            self._threads.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, rows)
        self._apply(logits, bitmask, rows)

    def mask_runs(self, logits: torch.Tensor, seqs: list, runs: list[list[int]]) -> None:
        """A verify step's masks, in place: `logits` holds len(run) + 1 rows per sequence, in order
        (row i scores the token after the sequence's run[:i]); a constrained sequence's rows are
        masked with its grammar after run[:i] (fill_run_bitmask), a free sequence's are left alone."""
        if not any(constrained(s) and not s.is_finished for s in seqs):
            return
        bitmask, rows, at = self._host_bitmask(logits.shape[0], logits.is_cuda), [], 0
        for seq, run in zip(seqs, runs):
            if constrained(seq) and not seq.is_finished:
                rows += range(at, at + fill_run_bitmask(seq.grammar, run, bitmask, at))
            at += len(run) + 1
        self._apply(logits, bitmask, rows)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        on_device = bitmask.to(logits.device, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=self.vocab_size, indices=rows)

    def _host_bitmask(self, rows: int, cuda: bool) -> torch.Tensor:
        """The host's bitmask rows, one buffer kept across steps (pinned on a GPU: a new pinned
        buffer a step costs more than the fill). Its copy to the device is queued behind the
        forward, so before the host writes the buffer again it waits for that copy, which in any
        schedule has already run: the ids of the step it masked were read back before."""
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.is_pinned() != cuda:
            self._bitmask = torch.empty((rows, (self.vocab_size + 31) // 32), dtype=torch.int32, pin_memory=cuda)
            self._copied = torch.cuda.Event() if cuda else None
        elif self._copied is not None:
            self._copied.synchronize()
        return self._bitmask[:rows]


def constrained(seq) -> bool:
    """The sequence's grammar holds its next token (it has one, and it waits for no start text)."""
    return seq.grammar is not None and seq.grammar_after is None


def arm_after(seq, before: int) -> None:
    """A waiting grammar starts once its start text is in the output: `before`, the text's length
    before the token just committed (the text can only have appeared across it)."""
    after = seq.grammar_after
    if seq.text.find(after, max(0, before - len(after) + 1)) >= 0:
        seq.grammar_after = None


def advance(seq, token: int) -> bool:
    """The sequence's matcher takes its committed token; True when the grammar has reached its end."""
    if not seq.grammar.accept_token(token):
        raise RuntimeError(f"structured outputs: token {token} is outside the grammar of request "
                           f"{seq.request.request_id} (the mask allowed it)")
    return seq.grammar.is_terminated()


# ---- speculative decoding under a grammar (ridge/engine/spec/) ------------------------------------
# A verify step scores a sequence's last token and its k drafts at once, so its k + 1 logits rows
# need k + 1 masks: row i the grammar's state after the committed tokens and drafts[:i]. The
# matcher walks the drafts to fill them and then rolls back all it walked, so that its state after
# equals its state before: only commit (`advance`) moves a matcher for good, token by token, and a
# rejected draft leaves nothing to undo.

def allowed_drafts(matcher, drafts: list[int]) -> int:
    """How many leading drafts the grammar lets a sequence take: up to the first it rejects (a
    draft outside the grammar cannot be accepted), and none after one that ends the grammar (the
    sequence ends there if that one is accepted). The matcher is walked and rolled back."""
    n = 0
    try:
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
    finally:
        matcher.rollback(n)
    return n


def fill_run_bitmask(matcher, drafts: list[int], bitmask: torch.Tensor, row: int) -> int:
    """Fill bitmask rows row, row + 1, ...: row + i with the tokens the grammar allows after
    drafts[:i], for i up to len(drafts) or the first draft the grammar rejects or ends on (the rows
    after that are never sampled from: a rejected draft is never accepted, and after the grammar's
    end the sequence ends). Returns the rows filled; the matcher is walked and rolled back."""
    walked, filled = 0, 0
    try:
        for i in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(bitmask, row + i)
            filled += 1
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            walked += 1
            if matcher.is_terminated():
                break
    finally:
        matcher.rollback(walked)
    return filled
