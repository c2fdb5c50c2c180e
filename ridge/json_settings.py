"""The settings given as JSON objects, as vLLM takes them: `speculative_config` (SpeculativeConfig)
and `kv_events_config` (KVEventsConfig), each parsed once into a frozen dataclass whose errors name
the key."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
METHOD_ALIASES = {"deepseek_mtp": "mtp"}       # vLLM's older name
MODEL_METHODS = ("draft_model", "eagle3")      # the methods that load a draft checkpoint


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config`, with vLLM's keys: method "ngram" (prompt lookup, no model), "suffix"
    (suffix decoding over the sequence and earlier outputs, no model), "draft_model" (`model`: a
    checkpoint with the target's vocabulary), "eagle3" (`model`: an EAGLE-3 head trained on the
    target's hidden states; ridge/engine/spec/eagle.py) or "mtp" (alias "deepseek_mtp": the target's
    own multi-token-prediction layer, DeepSeek-V3's; no model); `num_speculative_tokens` (k, the most drafts a step);
    prompt_lookup_min/max (the n-gram lengths tried, longest first); suffix_decoding_* (the longest
    match considered, drafts per matched token, the least path frequency a draft continues at, the
    finished outputs kept; ridge/engine/spec/suffix.py);
    `disable_by_batch_size`: no speculation in a step with more running sequences than this
    (default: where the verify pass stops being memory-bound, from the measured ceilings and the
    model's cost; ridge/engine/spec/speculator.py)."""
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """From the setting's dict (a JSON object on the command line); ValueError naming the key."""
        if isinstance(value, str):
            value = json_object(value)
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object like {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                             f"got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(known)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"{key!r} is required")
        if value["method"] in METHOD_ALIASES:
            value = {**value, "method": METHOD_ALIASES[value["method"]]}
        if value["method"] not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {value['method']!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = value.get(key, 1)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
        _check_suffix_keys(value)
        spec = cls(**value)
        if spec.prompt_lookup_max < spec.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({spec.prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({spec.prompt_lookup_min})")
        if (spec.method in MODEL_METHODS) != (spec.model is not None) or not isinstance(spec.model, (str, type(None))):
            raise ValueError(f"model: methods 'draft_model' and 'eagle3' need the draft checkpoint's directory (a path), "
                             f"and only they take one; got {spec.model!r} for {spec.method!r}")
        return spec


def _check_suffix_keys(value: dict) -> None:
    """The suffix_decoding_* keys: only with method "suffix", each in its range (ValueError naming it)."""
    keys = [k for k in value if k.startswith("suffix_decoding_")]
    if keys and value["method"] != "suffix":
        raise ValueError(f"{', '.join(keys)}: only method 'suffix' takes suffix_decoding_* keys, got {value['method']!r}")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    for key, ok, what in (
            ("suffix_decoding_max_tree_depth", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
             "an integer >= 1"),
            ("suffix_decoding_max_spec_factor", lambda v: number(v) and v > 0, "a number > 0"),
            ("suffix_decoding_min_token_prob", lambda v: number(v) and 0 <= v <= 1, "a number in [0, 1]"),
            ("suffix_decoding_max_cached_requests", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             "an integer >= 0 (0: no cache of earlier outputs)")):
        if key in value and not ok(value[key]):
            raise ValueError(f"{key} must be {what}, got {value[key]!r}")


class BadJson(argparse.ArgumentTypeError, ValueError):
    """A ValueError that argparse prints as it is (not as 'invalid _json_object value')."""


def json_object(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadJson(f"not valid JSON ({e}): {text!r}") from None


@dataclass(frozen=True)
class KVEventsConfig:
    """`kv_events_config`, with vLLM's keys: `enable_kv_cache_events` (publish, or not), `publisher`
    ("zmq"), `endpoint` (the PUB socket bound, default tcp://*:5557), `topic` (the first frame of each
    message), `hwm` (messages queued for a slow subscriber before newer ones are dropped). What is
    published and how: ridge/engine/kv_events.py. vLLM's replay socket (`replay_endpoint`,
    `buffer_steps`) is not offered: a subscriber that misses a batch sees the gap in the sequence
    numbers."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000

    @classmethod
    def parse(cls, value) -> "KVEventsConfig":
        if isinstance(value, str):
            value = json_object(value)
        if not isinstance(value, dict):
            raise ValueError(f'must be a JSON object like {{"enable_kv_cache_events": true}}, got {type(value).__name__}')
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key in ("replay_endpoint", "buffer_steps"):
                raise ValueError(f"{key}: ridge publishes no replay socket (a subscriber sees a missed batch as a "
                                 "gap in the sequence numbers)")
            if key not in known:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(known)})")
        cfg = cls(**value)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be true or false, got {cfg.enable_kv_cache_events!r}")
        if cfg.publisher != "zmq":
            raise ValueError(f"publisher must be 'zmq', got {cfg.publisher!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, key), str):
                raise ValueError(f"{key} must be a string, got {getattr(cfg, key)!r}")
        if "://" not in cfg.endpoint:
            raise ValueError(f"endpoint must be a ZMQ address like tcp://*:5557, got {cfg.endpoint!r}")
        if isinstance(cfg.hwm, bool) or not isinstance(cfg.hwm, int) or cfg.hwm < 1:
            raise ValueError(f"hwm must be an integer >= 1, got {cfg.hwm!r}")
        return cfg
