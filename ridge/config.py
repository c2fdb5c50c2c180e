"""Engine configuration: `EngineConfig` is the one list of engine settings; the settings given as
JSON objects are parsed by ridge/json_settings.py (`SpeculativeConfig`, `KVEventsConfig`, re-exported
here). The model's own configuration (`ModelConfig`, read from config.json) is
ridge/model_config.py's, re-exported here.
"""
from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field

import torch

from ridge import settings
from ridge.json_settings import MODEL_METHODS, KVEventsConfig, SpeculativeConfig, json_object
from ridge.model_config import ModelConfig, parse_dtype
from ridge.parallel import launched
from ridge.settings import setting

def _device_check(value) -> str | None:
    if isinstance(value, torch.device):
        return None if value.type in ("cpu", "cuda") else f"must be auto, cpu or cuda, got {value}"
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return f"must be auto, cpu, cuda or cuda:N, got {value!r}"


def _trace_dir_check(value) -> str | None:
    if not value:
        return "must name a directory, got an empty string"
    if os.path.exists(value) and not os.path.isdir(value):
        return f"is a file, not a directory: {value!r}"
    return None


def _bytes(text: str) -> int:
    """Command-line bytes: an integer, also written as a float (4e6) or with a K/M/G/T(iB) suffix."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    for i, unit in enumerate("KMGT"):
        if t.endswith(unit):
            t, scale = t[:-1], 1024 ** (i + 1)
    value = float(t) * scale
    if not value.is_integer():
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


@dataclass
class EngineConfig:
    """The engine's settings, the one list of them: `LLM(**settings)` takes exactly these fields
    and every command's engine flags are generated from them (ridge.settings). Adding a setting is
    adding a field here; the runner or engine reads it from the config it is given.

    `LLM` validates an instance, then resolves it against the model and the machine (`model` to a
    directory, `device` and `dtype` to torch objects, `max_model_len` to a number) and sizes the
    KV pool (`num_pages`, which is not a setting)."""

    model: str | None = setting(None, help="HF checkpoint directory, or a bundled model's name (demo-code-12m, demo-code-3m)",
                               default_text="the bundled demo model")
    device: str | torch.device = setting("auto", help="auto, cpu, cuda or cuda:N", check=_device_check,
                                         default_text="auto: cuda if available, else cpu")
    dtype: str | torch.dtype = setting(
        "auto", choices=("auto", "float32", "bfloat16", "float16"), help="weight and activation dtype",
        default_text="auto: float32 on a CPU; on a GPU the checkpoint's dtype, bfloat16 for a float32 checkpoint")
    max_model_len: int | None = setting(None, minimum=2, help="longest sequence, prompt and output together",
                                        default_text="the model's max_position_embeddings")
    max_num_seqs: int = setting(128, minimum=1, help="sequences decoded together (seats in a batch)")
    max_num_batched_tokens: int = setting(4096, minimum=1, help="tokens one step may process (the prefill budget)")
    kv_cache_memory: int | None = setting(
        None, minimum=1, parse=_bytes,
        help="KV-cache pool size in bytes (4e9, 4GiB); excludes --gpu-memory-utilization",
        default_text="85% of free GPU memory after loading; on a CPU 1 GiB or a quarter of free memory")
    gpu_memory_utilization: float | None = setting(
        None, above=0, maximum=1, help="fraction of the device's memory (GPU memory; system memory on a CPU) that "
        "weights, activations and KV cache may fill together; the KV pool gets what the loaded model leaves; "
        "excludes --kv-cache-memory", default_text="unset")
    page_size: int = setting(16, minimum=1, aliases=("--block-size",),
                             help="tokens per KV-cache page (--block-size: vLLM's name)")
    enable_prefix_caching: bool = setting(True, aliases=("--no-prefix-caching",),
                                          help="share the KV pages of equal prompt prefixes between requests")
    seed: int = setting(0, minimum=0, maximum=2**63 - 1, help="seed of unseeded sampling (and of dummy weights)")
    max_n: int = setting(64, minimum=1, help="most samples per prompt (a request's n)")
    enforce_eager: bool = setting(False, help="run decode steps eagerly instead of replaying CUDA graphs")
    async_scheduling: bool = setting(
        True, help="prepare and launch each decode step while the GPU still runs the previous one")
    attention_backend: str = setting("auto", choices=("auto", "torch", "triton"),
                                     help="attention kernels: triton on a GPU, torch (the reference) anywhere",
                                     default_text="auto: triton on a GPU when the head size allows, else torch")
    load_format: str = setting("auto", choices=("auto", "dummy"),
                               help="auto: read the checkpoint's safetensors; dummy: random weights from --seed, "
                                    "nothing read (for benchmarks)")
    quantization: str | None = setting(
        None, choices=("awq", "gptq", "compressed-tensors", "int4", "fp8"),
        help="INT4 weights (W4A16): awq, gptq or compressed-tensors name the format a quantized checkpoint must be "
             "in; int4 quantizes a float checkpoint at load (round to nearest, group 128). fp8: block-scaled W8A8 "
             "(e4m3, 128 x 128 weight blocks, activations per token and 128 channels), quantized at load from a "
             "float or HF fp8 checkpoint",
        default_text="the checkpoint's: config.json's quantization_config, else none")
    kv_cache_dtype: str = setting(
        "auto", choices=("auto", "fp8", "fp8_e4m3"),
        help="KV-cache storage: auto keeps the model dtype; fp8 (= fp8_e4m3) stores e4m3 with a power-of-two scale "
             "per token and kv head, twice the pages in the same memory")
    kv_cache_hadamard: bool = setting(
        False, help="with --kv-cache-dtype fp8: rotate q and k by a random-sign Hadamard matrix before k is "
                    "quantized (incoherent processing: spreads outlier channels; scores are unchanged)")
    speculative_config: dict | None = setting(
        None, parse=json_object,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram" | "suffix" | "draft_model" | "eagle3" | "mtp", '
             '"num_speculative_tokens": k, "model": DRAFT_PATH, "prompt_lookup_min": 1, "prompt_lookup_max": 4, '
             '"suffix_decoding_max_tree_depth": 24, '
             '"suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1, '
             '"suffix_decoding_max_cached_requests": 10000, "disable_by_batch_size": B}',
        default_text="off")
    tensor_parallel_size: int = setting(
        1, minimum=1, aliases=("-tp",),
        help="split the model across this many GPUs (CPU processes on a CPU), one process each: rank 0 "
             "schedules and samples, ranks 1.. run the same forward on their share of the heads and columns")
    distributed_executor_backend: str = setting(
        "mp", choices=("mp", "external_launcher"),
        help="with tensor_parallel_size > 1, who starts the ranks: mp, ridge (one process a GPU on this host); "
             "external_launcher, torchrun (torchrun --nproc-per-node N, across nodes with its rendezvous): rank 0 "
             "runs the engine, LLM(...) on the other ranks serves it until it closes, then exits the process")
    distributed_timeout_seconds: float = setting(
        300.0, above=0, help="with tensor_parallel_size > 1: a collective that waits longer than this for a rank "
                             "fails the engine (a hung rank); a rank that dies is reported at once")
    num_cpu_threads: int | None = setting(
        None, minimum=1, aliases=("--threads",),
        help="torch's compute threads in each engine process (torch.set_num_threads): on a CPU machine shared "
             "with other work, fewer threads than cores keep a step from waiting on a descheduled one",
        default_text="torch's: one per core; with tensor_parallel_size N on a CPU, the cores / N")
    trace_dir: str | None = setting(
        None, check=_trace_dir_check, help="write a trace of the serving path here (Chrome trace format, Perfetto opens it): the engine's "
                   "steps and their phases, garbage collections, Triton compiles and autotuning, a late event loop, "
                   "and each stall (a request's gap between two tokens over 10x the median); `ridge trace FILE` "
                   "names what overlapped each stall", default_text="off")
    kv_events_config: dict | None = setting(
        None, parse=json_object,
        help='publish the prefix cache\'s page events (stored, removed, all cleared) for a KV-aware router, vLLM\'s JSON '
             'and format: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
             '"topic": "", "hwm": 100000}', default_text="off")
    num_pages: int = field(default=0, init=False, repr=False)     # the KV pool, sized by LLM after loading
    # speculative_config parsed, once, at construction: what everything below reads
    speculation: SpeculativeConfig | None = field(default=None, init=False, repr=False, compare=False)
    kv_events: KVEventsConfig | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        kv = self.kv_cache_memory
        if isinstance(kv, float) and 0 < kv <= 1:
            raise ValueError(f"kv_cache_memory: is bytes, got {kv}; a fraction of memory is gpu_memory_utilization")
        settings.validate(self)
        if self.speculative_config is not None:
            try:
                self.speculation = SpeculativeConfig.parse(self.speculative_config)
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        if self.kv_events_config is not None:
            try:
                self.kv_events = KVEventsConfig.parse(self.kv_events_config)
            except ValueError as e:
                raise ValueError(f"kv_events_config: {e}") from None
        if self.kv_cache_memory is not None and self.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization: give it or kv_cache_memory, not both "
                             f"(got {self.gpu_memory_utilization} and {self.kv_cache_memory} bytes)")
        if self.kv_cache_hadamard and not self.fp8_kv_cache:
            raise ValueError("kv_cache_hadamard: rotates keys before FP8 quantization; it needs kv_cache_dtype='fp8' "
                             f"(got {self.kv_cache_dtype!r})")

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """A validated config from keyword arguments; a name that is not a setting is a ValueError."""
        settings.check_names(cls, kwargs, "engine setting")
        return cls(**kwargs)

    def as_kwargs(self) -> dict:
        """The settings as keyword arguments (for `LLM(**cfg.as_kwargs())`)."""
        return {name: getattr(self, name) for name in settings.names(self)}

    def resolve(self) -> tuple["EngineConfig", ModelConfig]:
        """This config against its checkpoint and this machine: `model` a directory, `device` and
        `dtype` torch objects, `max_model_len` a number within the model's limit."""
        import triton
        path = model_dir(self.model)
        model_cfg = ModelConfig.from_dir(path)
        dev = resolve_device(self.device)
        limit = model_cfg.max_position_embeddings
        max_len = self.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"max_model_len: must be in [2, {limit}] (the model's max_position_embeddings), "
                             f"got {max_len}")
        if self.attention_backend == "triton" and dev.type != "cuda" and not triton.knobs.runtime.interpret:
            # on a CPU the Triton kernels run only under Triton's interpreter (tests): say so now
            raise ValueError(f"attention_backend: 'triton' needs a CUDA device, and this engine runs on {dev} "
                             f"(use attention_backend='torch' or 'auto')")
        if model_cfg.eagle is not None:
            raise ValueError(f"model: {path!r} is an EAGLE-3 draft head ({model_cfg.architecture}); give it as "
                             f"speculative_config's model with method 'eagle3', beside its target model")
        spec = self.speculation
        if spec is not None and spec.model is not None:
            self._check_draft(ModelConfig.from_dir(model_dir(spec.model)), model_cfg)
        if spec is not None and spec.method == "mtp":
            try:
                model_cfg.mtp_head()
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        if self.kv_events_config is not None:
            try:
                self.kv_events = KVEventsConfig.parse(self.kv_events_config)
            except ValueError as e:
                raise ValueError(f"kv_events_config: {e}") from None
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel(model_cfg, dev)
        return dataclasses.replace(self, model=path, device=dev, dtype=resolve_dtype(self.dtype, model_cfg, dev),
                                   max_model_len=max_len), model_cfg

    def _check_draft(self, draft: ModelConfig, target: ModelConfig) -> None:
        """A speculative_config model against the target (ValueError naming the key)."""
        method = self.speculation.method
        if (draft.eagle is not None) != (method == "eagle3"):
            raise ValueError(f"speculative_config: {self.speculation.model!r} is "
                             f"{'an EAGLE-3 head: use method eagle3' if draft.eagle else 'not an EAGLE-3 head'} "
                             f"(got method {method!r})")
        if draft.eagle is not None:
            try:
                draft.eagle.check_target(draft, target)
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        if self.kv_events_config is not None:
            try:
                self.kv_events = KVEventsConfig.parse(self.kv_events_config)
            except ValueError as e:
                raise ValueError(f"kv_events_config: {e}") from None
        elif draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) must be "
                             f"the target's ({target.vocab_size})")

    def _check_tensor_parallel(self, m: ModelConfig, dev: torch.device) -> None:
        """What ridge splits so far: the Llama family's heads and MLP columns (experts' too); INT4
        groups and packed words are checked as each layer loads (ridge/layers/quant/int4/linear.py)."""
        tp, name = self.tensor_parallel_size, "tensor_parallel_size"
        spec = self.speculation
        unsupported = ("latent attention (DeepSeek)" if m.mla is not None else
                       "speculative decoding with a draft model" if spec and spec.method in MODEL_METHODS else None)
        if unsupported:
            raise ValueError(f"{name}: {unsupported} cannot run tensor-parallel yet (got {tp})")
        widths = (("the number of attention heads", m.num_heads), ("the MLP's intermediate size", m.intermediate_size))
        if m.moe is not None:
            widths += (("each expert's intermediate size", m.moe.expert_size),
                       ("the shared expert's intermediate size", m.moe.shared_expert_size))
        for what, n in widths:
            if n % tp:
                raise ValueError(f"{name}: {what} ({n}) must be divisible by it, got {tp}")
        if m.num_kv_heads % tp and tp % m.num_kv_heads:
            raise ValueError(f"{name}: the KV heads ({m.num_kv_heads}) must be divisible by it, or it by them "
                             f"(each rank then holds a copy of one KV head), got {tp}")
        if self.distributed_executor_backend == "external_launcher":
            job = launched()
            if job.size != tp:
                raise ValueError(f"{name}: must be the number of processes torchrun started ({job.size}), got {tp}")
            gpus = job.local_size
        else:
            gpus = tp
        if dev.type == "cuda" and (dev.index or gpus > torch.cuda.device_count()):
            raise ValueError(f"{name}: a rank runs on cuda:<its local rank>, so the device must be 'cuda' (or auto) "
                             f"and {gpus} GPUs visible; got device {dev} with {torch.cuda.device_count()} GPUs")

    def kv_budget(self) -> int:
        """Bytes for the KV pool of a resolved config, measured after the model is loaded."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            free, total = (os.sysconf(n) * os.sysconf("SC_PAGE_SIZE") for n in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"))
        if self.gpu_memory_utilization is not None:
            # what the fraction of the whole device leaves once everything now in use is counted
            return int(self.gpu_memory_utilization * total) - (total - free)
        return int(0.85 * free) if self.device.type == "cuda" else min(DEFAULT_CPU_KV_BYTES, free // 4)


DEFAULT_CPU_KV_BYTES = 1 << 30


def model_dir(model: str | None) -> str:
    """The checkpoint directory a `model` setting names: a directory, else a bundled model's name
    ("demo-code-12m", found beside ridge's own files, whatever the working directory); None: the
    demo model. The target model and the draft model are both resolved here."""
    from ridge.assets import bundled_model_path, bundled_models, demo_model_path
    if model is None:
        return demo_model_path()
    if os.path.isdir(model):
        return model
    bundled = bundled_model_path(model)
    if bundled is None:
        raise ValueError(f"model: {model!r} is neither a directory (ridge loads local HF checkpoint directories) "
                         f"nor a bundled model's name ({', '.join(bundled_models())})")
    return bundled


def resolve_device(device: str | torch.device) -> torch.device:
    """A `device` setting (as EngineConfig checked it) on this machine."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: CPUs run float32 fastest and most exactly; on a GPU the checkpoint's own dtype is used,
    except that float32 checkpoints run in bfloat16 (tensor cores, half the bytes)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    ckpt = model_cfg.checkpoint_dtype
    return torch.float32 if device.type == "cpu" else torch.bfloat16 if ckpt == torch.float32 else ckpt
