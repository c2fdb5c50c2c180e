"""`LLM`: the offline Python API (the shape vLLM users know)."""
from __future__ import annotations

import os

import torch
from tqdm.auto import tqdm

from ridge.config import EngineConfig, ModelConfig, parse_dtype
from ridge.engine.engine import Engine
from ridge.engine.request import RequestOutput
from ridge.engine.sampling_params import SamplingParams
from ridge.runner.model_runner import ModelRunner

DEFAULT_CPU_KV_BYTES = 1 << 30


def default_model_path() -> str:
    """The demo checkpoint bundled with ridge."""
    from ridge.assets import demo_model_path
    return demo_model_path()


def load_tokenizer(path: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}")
    return dev


def _resolve_dtype(dtype: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    # CPUs run float32 fastest and most exactly; on a GPU the checkpoint's own dtype is used,
    # except that float32 checkpoints run in bfloat16 (tensor cores, half the bytes).
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if model_cfg.checkpoint_dtype == torch.float32 else model_cfg.checkpoint_dtype


def _kv_budget(kv_cache_memory, device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if kv_cache_memory is None:
        return int(0.85 * free) if device.type == "cuda" else min(DEFAULT_CPU_KV_BYTES, free // 4)
    if isinstance(kv_cache_memory, float):
        if not 0 < kv_cache_memory <= 1:
            raise ValueError(f"kv_cache_memory: a fraction must be in (0, 1], got {kv_cache_memory}")
        return int(kv_cache_memory * free)
    if isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
        return kv_cache_memory
    raise ValueError(f"kv_cache_memory: expected bytes (int > 0) or a fraction (float), got {kv_cache_memory!r}")


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int = 4096, kv_cache_memory: int | float | None = None,
                 page_size: int = 16, enable_prefix_caching: bool = True, seed: int = 0,
                 max_n: int = 64, attention_backend: str = "auto", show_progress: bool = True,
                 enforce_eager: bool = False, async_scheduling: bool = True):
        path = model if model is not None else default_model_path()
        if not os.path.isdir(path):
            raise ValueError(f"model: {path!r} is not a directory (ridge loads local HF checkpoint directories)")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("page_size", page_size), ("max_n", max_n)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        model_cfg = ModelConfig.from_dir(path)
        dev = _resolve_device(device)
        max_len = max_model_len or model_cfg.max_position_embeddings
        if not isinstance(max_len, int) or not 1 < max_len <= model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: must be in [2, {model_cfg.max_position_embeddings}] "
                             f"(the model's max_position_embeddings), got {max_model_len!r}")
        cfg = EngineConfig(model=path, dtype=_resolve_dtype(dtype, model_cfg, dev), device=dev,
                           max_model_len=max_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
                           num_pages=0, enable_prefix_caching=enable_prefix_caching, seed=seed, max_n=max_n,
                           enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                           attention_backend=attention_backend)
        runner = ModelRunner(cfg, model_cfg, show_progress=show_progress)
        cfg.num_pages = _kv_budget(kv_cache_memory, dev) // runner.kv_bytes_per_page()
        if cfg.num_pages < 1:
            raise ValueError("kv_cache_memory: too small to hold a single KV page")
        runner.allocate_kv_cache(cfg.num_pages)
        runner.warm_up_prefill()
        runner.setup_decode(use_graphs=not enforce_eager)
        self.engine = Engine(cfg, model_cfg, runner, load_tokenizer(path))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:                   # all or nothing: the call's other requests go too
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this checkpoint has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt_ids(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending, done = set(ids), {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
