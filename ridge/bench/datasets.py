"""Request lists for the benchmarks: synthetic (random token ids, lengths drawn uniformly in a
range) and ShareGPT conversations (real prompts, real reply lengths).

Prompts are token ids, tokenized once here, so that the timed run measures the engine and not
the tokenizer."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def special_token_ids(model_cfg, tokenizer=None) -> set[int]:
    """Ids a random prompt must not contain: BOS/EOS from the model config and every special or
    added-special token of the tokenizer (an EOS inside a prompt is harmless to ridge, but a peer
    that infers padding from pad ids would not see the same prompt)."""
    ids = set(model_cfg.eos_token_ids)
    if model_cfg.bos_token_id is not None:
        ids.add(model_cfg.bos_token_id)
    if tokenizer is not None:
        ids.update(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                ids.add(int(tid))
    return {i for i in ids if isinstance(i, int) and i >= 0}


class RandomPrompts:
    """Seeded random prompts over the vocabulary minus the special ids; each draw is fresh."""

    def __init__(self, vocab_size: int, avoid: set[int], seed: int):
        allowed = torch.ones(vocab_size, dtype=torch.bool)
        bad = [i for i in avoid if i < vocab_size]
        if bad:
            allowed[bad] = False
        self.allowed = allowed.nonzero().squeeze(1)
        if len(self.allowed) == 0:
            raise ValueError("vocabulary: every token id is special; no random prompt can be drawn")
        self.gen = torch.Generator().manual_seed(seed)

    def draw(self, length: int) -> list[int]:
        idx = torch.randint(len(self.allowed), (length,), generator=self.gen)
        return self.allowed[idx].tolist()


def check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1:
        raise ValueError(f"{name}: lengths must be >= 1, got {lo}")
    if lo > hi:
        raise ValueError(f"{name}: LO ({lo}) is greater than HI ({hi})")


def synthetic_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                       prompts: RandomPrompts, seed: int) -> list[BenchRequest]:
    """`num` requests whose input and output lengths are uniform integers in the inclusive ranges."""
    if num < 1:
        raise ValueError(f"num-prompts: must be >= 1, got {num}")
    check_range("input-len", *input_range)
    check_range("output-len", *output_range)
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_range), rng.randint(*output_range)
        out.append(BenchRequest(prompts.draw(n_in), n_out))
    return out


@dataclass
class ShareGPTLoad:
    requests: list[BenchRequest]
    entries: int                       # entries in the file
    skipped_malformed: int             # not a conversation with a human turn and a gpt reply after it
    skipped_too_long: int              # prompt + reply do not fit max_model_len
    scanned: int                       # entries looked at (the scan stops once num_prompts are usable)


_HUMAN, _GPT = ("human", "user"), ("gpt", "assistant", "chatgpt", "bard")


def _first_exchange(entry) -> tuple[str, str] | None:
    """(first human turn, first gpt reply after it), or None when the entry has no such pair."""
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        return None
    turns = entry["conversations"]
    prompt = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        who = str(turn.get("from", "")).lower()
        if prompt is None and who in _HUMAN and turn["value"].strip():
            prompt = turn["value"]
        elif prompt is not None and who in _GPT and turn["value"].strip():
            return prompt, turn["value"]
    return None


def load_sharegpt(path: str, tokenizer, max_model_len: int, num_prompts: int | None = None,
                  seed: int = 0, output_len: int | None = None) -> ShareGPTLoad:
    """Requests from a ShareGPT-format file: a JSON list of {"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}. Prompt = the first human turn, tokenized as
    the engine would (special tokens added); output length = the tokenized length of the first gpt
    reply after it (no special tokens), or `output_len` when given. Entries without such a pair are
    skipped and counted, as are pairs longer than max_model_len. Entries are visited in a seeded
    shuffle until `num_prompts` are usable (all usable ones when None or when fewer exist)."""
    if tokenizer is None:
        raise ValueError("dataset: a ShareGPT file needs a tokenizer, and this model directory has none")
    if not os.path.isfile(path):
        raise ValueError(f"dataset: no such file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset: {path!r} is not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset: {path!r} must hold a JSON list of conversations, got {type(data).__name__}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num-prompts: must be >= 1, got {num_prompts}")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    malformed = too_long = scanned = 0
    reqs = []
    for i in order:
        scanned += 1
        pair = _first_exchange(data[i])
        if pair is None:
            malformed += 1
            continue
        prompt_ids = list(tokenizer(pair[0])["input_ids"])
        n_out = output_len if output_len is not None else len(tokenizer(pair[1], add_special_tokens=False)["input_ids"])
        if not prompt_ids or n_out < 1:
            malformed += 1
            continue
        if len(prompt_ids) + n_out > max_model_len:
            too_long += 1
            continue
        reqs.append(BenchRequest(prompt_ids, n_out))
        if num_prompts is not None and len(reqs) == num_prompts:
            break
    if not reqs:
        raise ValueError(f"dataset: no usable conversation in {path!r} ({len(data)} entries: {malformed} malformed "
                         f"(no human turn followed by a gpt reply), {too_long} longer than max_model_len={max_model_len})")
    return ShareGPTLoad(reqs, len(data), malformed, too_long, scanned)
