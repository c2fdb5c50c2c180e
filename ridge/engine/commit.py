"""Committing sampled tokens: append each to its sequence (or fill the placeholder an overlapped
step left), record log-probabilities, detokenize, and decide whether the token ends the sequence
(stop token, stop string, a structured output's end, max_tokens, context length). Each sequence detokenizes through a
DecodeStream, which emits text only once a whole UTF-8 piece is known (a character split across
tokens is held back), so the cumulative text is always valid and never rewritten."""
from __future__ import annotations

import time

import torch

from ridge.engine.request import Logprob, Request, Sequence
from ridge.engine.structured import advance, arm_after
from ridge.engine.token_text import TokenTexts


class Committer:
    def __init__(self, max_model_len: int, eos_ids: list[int], tokenizer, scheduler):
        self.max_model_len, self.eos_ids, self.tokenizer, self.scheduler = max_model_len, eos_ids, tokenizer, scheduler
        self.generation_tokens = 0
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else (lambda tok: (None, None))

    def commit(self, seqs: list[Sequence], tokens: list[int], info,
               indices: list[int] | None = None) -> list[Request]:
        """Commit one token per sequence; returns the requests that got one. With `indices` the
        tokens fill the placeholders at those positions (an overlapped step), and a sequence
        finished meanwhile is skipped. `info`: the sampler's logprob tensors (on the host), or None."""
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
                chosen, rank, top_v, top_i = info
                k = req.params.logprobs
                seq.logprobs.append(self.logprob_entry(tok, float(chosen[i]), int(rank[i]),
                                                       top_i[i, :k].tolist() if k else (),
                                                       top_v[i, :k].tolist() if k else ()))
            reason = self.finish_reason(seq, tok, length)
            if reason is not None:
                del seq.token_ids[length:]          # a later step's placeholder, if one was launched
                seq.num_pending = 0
                self.scheduler.finish(seq, reason)
                req.finished_time = now if req.is_finished else None
            touched[req.request_id] = req
            self.generation_tokens += 1
        return list(touched.values())

    def commit_runs(self, seqs: list[Sequence], runs: list[list[int]],
                    infos: list[list[tuple | None]]) -> list[Request]:
        """Commit several tokens per sequence (a verify step's emitted run), one position at a time
        across the sequences, so a stop or a length limit ends a run where plain decoding would; a
        run's tokens after that are dropped. `infos`: per token its logprob info (host tensors) or None."""
        touched = []
        for j in range(max(map(len, runs), default=0)):
            at = [r for r, run in enumerate(runs) if len(run) > j and not seqs[r].is_finished]
            if not at:
                break
            info = None
            if any(infos[r][j] is not None for r in at):
                info = tuple(torch.stack([infos[r][j][c] for r in at]) if infos[at[0]][j][c] is not None else None
                             for c in range(4))
            touched += self.commit([seqs[r] for r in at], [runs[r][j] for r in at], info)
        return touched

    def finish_reason(self, seq: Sequence, tok: int, length: int) -> str | None:
        """Why `tok`, the sequence's token number `length`, ends it (None: it does not)."""
        params = seq.request.params
        num_output = length - seq.num_prompt_tokens
        before = len(seq.text)
        if tok in (params.stop_token_ids or []) or (not params.ignore_eos and tok in self.eos_ids):
            return "stop"     # min_tokens is enforced by banning these tokens until then
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.step(self.tokenizer.backend_tokenizer, tok) or ""
            if params.stop_strings and num_output >= params.min_tokens:
                # a stop string can only end inside the new piece: search from just before it
                start = max(0, before - max(map(len, params.stop_strings)) + 1)
                hits = [i for s in params.stop_strings if (i := seq.text.find(s, start)) >= 0]
                if hits:
                    seq.text = seq.text[:min(hits)]
                    return "stop"
        if seq.grammar is not None:
            if seq.grammar_after is not None:
                arm_after(seq, before)      # the grammar holds the tokens after this one
            elif advance(seq, tok):
                return "stop"     # the structured output is complete
        if num_output >= seq.request.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def record_prompt_logprobs(self, seq: Sequence, start: int, targets: list[int], info) -> None:
        """The entries of prompt positions start, start + 1, ...: each prompt token and the top-k
        candidates there (`info`: logprob_info of `targets`, on the host, k columns). Read as
        lists once: a scoring request has an entry per prompt token, not per step."""
        k = seq.request.params.prompt_logprobs
        chosen, rank, top_v, top_i = (x.tolist() if x is not None else None for x in info)
        for i, tok in enumerate(targets):
            seq.prompt_logprobs[start + i] = self.logprob_entry(tok, chosen[i], rank[i], top_i[i] if k else (),
                                                                top_v[i] if k else ())

    def logprob_entry(self, tok: int, logprob: float, rank: int, top_ids=(), top_values=()) -> dict[int, Logprob]:
        """The token and its top candidates (best first), each named by the text it contributes
        (TokenTexts: one cached lookup per id, whatever the sequence's length)."""
        texts = self.token_texts
        entry = {tok: Logprob(logprob, rank, *texts(tok))}
        for r, (t, v) in enumerate(zip(top_ids, top_values), start=1):
            if t not in entry:
                entry[t] = Logprob(v, r, *texts(t))
        return entry
