"""EngineConfig is the one list of engine settings: LLM's keywords and every command's flags come
from it, and every value is checked (ValueError naming the setting) before anything loads."""
import argparse
import dataclasses
import inspect
import math

import pytest
import torch

from ridge import LLM, settings
from ridge.cli import build_parser
from ridge.config import EngineConfig
from ridge.server.config import ServerConfig


def _engine_flags(command: list[str]) -> dict[str, str]:
    """option string -> dest of the flags in a (sub)command's 'engine' group."""
    sub = build_parser()
    for name in command:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    group = next(g for g in sub._action_groups if g.title == "engine")
    return {opt: a.dest for a in group._group_actions for opt in a.option_strings}


# -- every field validates ---------------------------------------------------------------------------
BAD = [
    ("model", 5), ("device", "tpu"), ("device", 1), ("dtype", "int8"), ("dtype", None),
    ("max_model_len", 0), ("max_model_len", 1), ("max_model_len", True), ("max_model_len", 2.5),
    ("max_num_seqs", 0), ("max_num_seqs", True), ("max_num_seqs", "8"),
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", None),
    ("kv_cache_memory", 0), ("kv_cache_memory", 0.5), ("kv_cache_memory", 1.5), ("kv_cache_memory", True),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", math.inf),
    ("gpu_memory_utilization", math.nan), ("gpu_memory_utilization", True),
    ("page_size", 0), ("page_size", False),
    ("enable_prefix_caching", 1), ("enable_prefix_caching", "no"),
    ("seed", "x"), ("seed", -1), ("seed", 2**64), ("seed", True), ("seed", 1.0),
    ("max_n", 0), ("max_n", True),
    ("enforce_eager", "yes"), ("enforce_eager", 0),
    ("async_scheduling", None),
    ("attention_backend", "flash"), ("attention_backend", None),
    ("load_format", "pt"),
    ("quantization", "fp16"), ("quantization", 4),
    ("kv_cache_dtype", "fp8_e5m2"), ("kv_cache_dtype", None), ("kv_cache_hadamard", 1), ("kv_cache_hadamard", "yes"),
    ("speculative_config", "ngram"), ("speculative_config", {"method": "eagle", "num_speculative_tokens": 2}),
    ("speculative_config", {"method": "ngram"}), ("speculative_config", {"method": "ngram", "num_speculative_tokens": 0}),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": True}),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2, "k": 2}),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                            "prompt_lookup_max": 2}),
    ("speculative_config", {"method": "draft_model", "num_speculative_tokens": 2}),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2, "model": "/tmp"}),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}),
    ("tensor_parallel_size", 0), ("tensor_parallel_size", 1.5), ("tensor_parallel_size", True),
    ("distributed_timeout_seconds", 0), ("distributed_timeout_seconds", math.inf),
    ("distributed_executor_backend", "ray"), ("distributed_executor_backend", None),
    ("num_cpu_threads", 0), ("num_cpu_threads", True), ("num_cpu_threads", 1.5),
    ("trace_dir", ""), ("trace_dir", 5), ("trace_dir", __file__),
    ("kv_events_config", 5), ("kv_events_config", {"replay_endpoint": "tcp://*:5558"}),
    ("kv_events_config", {"publisher": "nats"}), ("kv_events_config", {"hwm": 0}),
    ("kv_events_config", {"endpoint": "5557"}), ("kv_events_config", {"enable_kv_cache_events": "yes"}),
]


def test_every_setting_has_a_bad_value_case():
    assert {name for name, _ in BAD} == set(settings.names(EngineConfig))


@pytest.mark.parametrize("name, value", BAD)
def test_bad_value_names_the_setting(name, value):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        EngineConfig(**{name: value})


def test_good_values_accepted():
    cfg = EngineConfig(device="cuda:1", dtype=torch.bfloat16, max_model_len=2, kv_cache_memory=1 << 20,
                       gpu_memory_utilization=None, seed=2**63 - 1, enforce_eager=True, load_format="dummy")
    assert cfg.device == "cuda:1" and cfg.dtype is torch.bfloat16
    EngineConfig(gpu_memory_utilization=1)            # an int is a number
    EngineConfig(device=torch.device("cpu"))


def test_kv_cache_memory_and_gpu_memory_utilization_exclude_each_other():
    with pytest.raises(ValueError, match="^gpu_memory_utilization:.*not both"):
        EngineConfig(kv_cache_memory=1 << 30, gpu_memory_utilization=0.5)


def test_unknown_setting_suggests_close_names():
    with pytest.raises(ValueError, match=r"^max_num_seq: not an engine setting; did you mean max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)


# -- LLM takes exactly the fields, validated before anything loads ------------------------------------
def test_llm_keywords_are_the_fields():
    params = inspect.signature(LLM).parameters
    assert list(params) == settings.names(EngineConfig) + ["show_progress"]
    assert all(params[n].default == f.default for n, f in EngineConfig.__dataclass_fields__.items() if n in params)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_model_len=0), "max_model_len"), (dict(seed="x"), "seed"), (dict(enforce_eager="yes"), "enforce_eager"),
    (dict(max_num_seqs=True), "max_num_seqs"), (dict(gpu_memory_utilization=math.inf), "gpu_memory_utilization"),
    (dict(max_num_seqz=3), "max_num_seqz"), (dict(show_progress="no"), "show_progress"),
])
def test_llm_rejects_before_loading(monkeypatch, kwargs, name):
    import ridge.engine.llm as llm_module

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(llm_module, "ModelRunner", no_loading)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        LLM(device="cpu", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_backend_without_cuda_is_rejected_up_front(monkeypatch):
    import ridge.engine.llm as llm_module
    # the knob reads the variable per call; setting the knob itself would pin it for later tests
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(llm_module, "ModelRunner", None)          # never reached
    with pytest.raises(ValueError, match="^attention_backend: 'triton' needs a CUDA device"):
        LLM(device="cpu", attention_backend="triton")


def test_gpu_memory_utilization_sizes_the_pool(checkpoints):
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, gpu_memory_utilization=1.0)
    assert llm.engine.cfg.num_pages >= 1
    with pytest.raises(ValueError, match="^gpu_memory_utilization: too small"):
        LLM(checkpoints("llama"), device="cpu", show_progress=False, gpu_memory_utilization=1e-9)


# -- flags --------------------------------------------------------------------------------------------
def _parse(cls, argv, defaults=None):
    p = argparse.ArgumentParser()
    settings.add_arguments(p, cls, defaults=defaults)
    return p.parse_args(argv)


def test_flags_round_trip():
    cfg = EngineConfig(model="/m", device="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=3,
                       max_num_batched_tokens=99, kv_cache_memory=4_000_000, page_size=8,
                       enable_prefix_caching=False, seed=7, max_n=2, enforce_eager=True, async_scheduling=False,
                       attention_backend="torch", load_format="dummy", quantization="compressed-tensors")
    assert settings.from_args(EngineConfig, _parse(EngineConfig, settings.to_args(cfg))) == cfg
    frac = EngineConfig(gpu_memory_utilization=0.5)
    assert settings.from_args(EngineConfig, _parse(EngineConfig, settings.to_args(frac))) == frac
    assert settings.from_args(EngineConfig, _parse(EngineConfig, [])) == EngineConfig()
    srv = ServerConfig(model_name="m", host="0.0.0.0", port=1, api_key="k", max_stop=2, log_level="debug")
    assert settings.from_args(ServerConfig, _parse(ServerConfig, settings.to_args(srv))) == srv


def test_aliases_and_switches():
    a = _parse(EngineConfig, ["--block-size", "32", "--no-prefix-caching", "--no-async-scheduling",
                              "--kv-cache-memory", "4e6"])
    cfg = settings.from_args(EngineConfig, a)
    assert (cfg.page_size, cfg.enable_prefix_caching, cfg.async_scheduling, cfg.kv_cache_memory) == \
        (32, False, False, 4_000_000)
    assert settings.from_args(EngineConfig, _parse(EngineConfig, ["--kv-cache-memory", "2GiB"])).kv_cache_memory \
        == 2 << 30
    assert settings.from_args(EngineConfig, _parse(EngineConfig, ["--enable-prefix-caching"])).enable_prefix_caching


def test_num_cpu_threads_sets_torchs_threads(checkpoints):
    """The CPU backend's thread count is a setting (flag --num-cpu-threads, or --threads): on a
    machine shared with other work, fewer threads than cores keep a step from waiting on one."""
    assert settings.from_args(EngineConfig, _parse(EngineConfig, ["--threads", "3"])).num_cpu_threads == 3
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        from ridge import LLM
        LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=64, num_cpu_threads=want).close()
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_bad_flag_value_names_the_setting():
    with pytest.raises(ValueError, match="^max_num_seqs:"):
        settings.from_args(EngineConfig, _parse(EngineConfig, ["--max-num-seqs", "0"]))
    with pytest.raises(ValueError, match="^gpu_memory_utilization:"):
        settings.from_args(EngineConfig, _parse(EngineConfig, ["--gpu-memory-utilization", "inf"]))


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["eval-ppl"], ["bench", "latency"],
                                     ["bench", "throughput"], ["roofline"]])
def test_every_engine_command_has_every_setting(command):
    flags = _engine_flags(command)
    assert set(flags.values()) == set(settings.names(EngineConfig))
    assert flags["--block-size"] == flags["--page-size"] == "page_size"


def test_serve_and_generate_list_the_same_engine_flags():
    assert _engine_flags(["serve"]) == _engine_flags(["generate"])


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["eval-ppl"], ["bench", "latency"],
                                     ["bench", "throughput"], ["roofline"]])
def test_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(command + ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f, s, _ in settings.fields(EngineConfig):
        assert settings.flag_of(f, s) in text
    for shown in ("--max-num-seqs N sequences decoded together", "(default: 16)", "--attention-backend",
                  "--gpu-memory-utilization", "--load-format"):
        assert shown in text
    assert text.count("(default:") >= len(settings.names(EngineConfig))


def test_serve_caps_n_lower_and_roofline_sizes_seats_itself():
    a = build_parser().parse_args(["serve"])
    assert a.max_n == 16 and a.port == 8000 and a.model_name is None
    a = build_parser().parse_args(["roofline"])
    assert a.max_num_seqs is None and a.max_num_batched_tokens is None and a.attention_backend == "auto"


def test_server_config_validates():
    for kwargs, name in ((dict(model_name=""), "model_name"), (dict(), "model_name"),
                         (dict(model_name="m", port=70000), "port"), (dict(model_name="m", api_key=""), "api_key"),
                         (dict(model_name="m", max_logprobs=21), "max_logprobs"),
                         (dict(model_name="m", max_stop=True), "max_stop")):
        with pytest.raises(ValueError, match=rf"^{name}:"):
            ServerConfig(**kwargs)


def test_describe_lists_every_setting():
    text = settings.describe(EngineConfig)
    assert all(f"{name} (--" in text for name in settings.names(EngineConfig))


def test_config_modules_import_nothing_above_them():
    import ast
    import ridge.config
    import ridge.json_settings
    import ridge.model_config
    import ridge.settings
    for mod in (ridge.config, ridge.json_settings, ridge.model_config, ridge.settings):
        tree = ast.parse(open(mod.__file__).read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        # ridge.assets (the bundled demo model's path) and ridge.parallel (torchrun's environment)
        # sit beside them, below everything else
        assert {m for m in imported if m.startswith("ridge")} <= {"ridge", "ridge.settings", "ridge.assets",
                                                                  "ridge.model_config", "ridge.parallel",
                                                                  "ridge.json_settings"}
    assert dataclasses.is_dataclass(EngineConfig)
