"""The step message: everything a tensor-parallel rank needs to run one step's forward exactly as
rank 0 runs it, in the fixed binary layout of ridge/runner/step_ring.py's `encode_arrays` (no
pickle on the wire). Rank 0 turns a scheduled step into a `StepPlan` (ModelRunner.plan); every
rank, rank 0 included, runs the plan (ModelRunner.run), so the ranks make the same collectives in
the same order.

A plan is host data only. A decode step launched before the previous step's ids reached the host
(async scheduling) names, instead of input ids, the row of each sequence's id in the previous
step's sampled ids (`previous_rows`): those ids are on rank 0's device only, and one broadcast of
`num_previous` ids carries them to the other ranks' devices at the start of the step.

Layout (kind, then 15 one-dimensional arrays, always all present, empty where unused):
    SETUP:  [num_pages, use_graphs, verify_queries, verify_max_bs] (int64)
    STOP:   no arrays
    EAGER / DECODE / VERIFY:
        0 [num_previous, has previous] int64    1 page copies (src, dst pairs) int64
        2 input ids int64    3 positions int64    4 cache slots int64
        5 sequence lengths int32    6 page-table lengths int32    7 page tables end to end int32
        8 query starts int32 (eager)    9 sample rows int64    10 previous rows int64
        11 score rows int64    12 score lengths int32    13 score targets int64
        14 score top-k (the prompt_logprobs each span reports) int32
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ridge.runner.cuda_graphs import DecodeInputs
from ridge.runner.step_ring import decode_arrays, encode_arrays

SETUP, EAGER, DECODE, VERIFY, STOP = 1, 2, 3, 4, 5
_ARRAYS = 15
_I32, _I64 = np.int32, np.int64


@dataclass
class StepPlan:
    """One step's forward, as host lists. EAGER: the flat batch (`query_starts`: each sequence's
    first row, and the total), logits of `sample_rows`, prompt log-probabilities of each span of
    rows from `score_rows` (its targets: the next tokens). DECODE / VERIFY: the static padded path
    (CUDA graphs); VERIFY's `sample_rows` are the logits rows that sample."""
    kind: int
    inputs: DecodeInputs
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    previous_rows: list[int] | None = None
    num_previous: int = 0
    score_rows: list[int] = field(default_factory=list)
    score_targets: list[list[int]] = field(default_factory=list)
    score_top: list[int] = field(default_factory=list)


def encode_plan(plan: StepPlan) -> bytes:
    s = plan.inputs
    prev = plan.previous_rows
    return encode_arrays(plan.kind, [
        np.array([plan.num_previous, prev is not None], _I64),
        np.array(list(itertools.chain.from_iterable(plan.page_copies)), _I64),
        np.array(s.input_ids, _I64), np.array(s.positions, _I64), np.array(s.slots, _I64),
        np.array(s.seq_lens, _I32), np.array([len(t) for t in s.page_tables], _I32),
        np.fromiter(itertools.chain.from_iterable(s.page_tables), _I32),
        np.array(plan.query_starts, _I32), np.array(plan.sample_rows, _I64), np.array(prev or [], _I64),
        np.array(plan.score_rows, _I64), np.array([len(t) for t in plan.score_targets], _I32),
        np.fromiter(itertools.chain.from_iterable(plan.score_targets), _I64), np.array(plan.score_top, _I32)])


def decode_plan(kind: int, arrays: list[np.ndarray]) -> StepPlan:
    if kind not in (EAGER, DECODE, VERIFY) or len(arrays) != _ARRAYS:
        raise ValueError(f"step message: kind {kind} with {len(arrays)} arrays is not a step")
    (head, copies, ids, positions, slots, seq_lens, table_lens, tables, starts, sample_rows, prev,
     score_rows, score_lens, targets, score_top) = arrays
    pairs = copies.reshape(-1, 2).tolist()
    return StepPlan(kind, DecodeInputs(ids.tolist(), positions.tolist(), slots.tolist(), seq_lens.tolist(),
                                       _split(tables, table_lens)),
                    [tuple(p) for p in pairs], starts.tolist(), sample_rows.tolist(),
                    prev.tolist() if head[1] else None, int(head[0]), score_rows.tolist(),
                    _split(targets, score_lens), score_top.tolist())


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n:e].tolist() for e, n in zip(ends.tolist(), lengths.tolist())]


def encode_setup(num_pages: int, use_graphs: bool, verify_queries: int, verify_max_bs: int) -> bytes:
    return encode_arrays(SETUP, [np.array([num_pages, use_graphs, verify_queries, verify_max_bs], _I64)])


def encode_stop() -> bytes:
    return encode_arrays(STOP, [])


def read_message(message: bytes) -> tuple[int, StepPlan | tuple[int, bool, int, int] | None]:
    """(kind, its content): a StepPlan, SETUP's (num_pages, use_graphs, verify_queries,
    verify_max_bs), or None for STOP."""
    kind, arrays = decode_arrays(message)
    if kind == STOP:
        return kind, None
    if kind == SETUP:
        pages, graphs, queries, max_bs = arrays[0].tolist()
        return kind, (pages, bool(graphs), queries, max_bs)
    return kind, decode_plan(kind, arrays)


def max_message_bytes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, page_size: int,
                      tokens_per_seq: int = 1) -> int:
    """The largest step message an engine with these settings can send (a ring slot's size): every
    array at its bound, `tokens_per_seq` tokens a sequence in a decode or verify step."""
    seqs, pages = max_num_seqs, -(-max_model_len // page_size)
    tokens = max(max_num_batched_tokens, seqs * tokens_per_seq)
    copies = tokens // page_size + 2 * seqs         # a chunk's pages, each a copy at most, plus its ends
    header = 8 + 5 * _ARRAYS
    # int64: head, copies, ids/positions/slots, sample rows, previous rows, score rows, targets;
    # int32: lengths, table lengths, tables, query starts, score lengths, score top-k
    return header + 8 * (2 + 2 * copies + 5 * tokens + 2 * seqs) + 4 * (5 * seqs + 1 + seqs * pages)
