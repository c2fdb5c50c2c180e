import importlib.util
from pathlib import Path
import os

import pytest
import torch

# Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors. Triton 3.6's
# @triton.jit reads TRITON_INTERPRET when a kernel is decorated, so it is set before anything imports
# ridge (whose modules define the kernels); newer Triton reads it through triton.knobs at each launch.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread in this process and the ones its tests start: the test models' ops take
    # microseconds, and OpenMP threads spinning at their barriers on cores that the other pytest-xdist
    # workers need make every engine step many times slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The Rust tokenizers' thread pool does not survive a fork (servers, ranks): off from the start, no process warns.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ridge.utils.random_checkpoint import make_random_checkpoint  # noqa: E402

# The GPU machines carry no serving packages (FastAPI, uvicorn, the openai client) unless a run brings
# them, and tests/server holds one GPU test, the soak: there the other modules are left uncollected,
# so `pytest -m gpu tests` runs in one process, and the GPU soak fails naming the missing package (its
# module imports the server inside its tests). Without CUDA (CI, a developer's CPU) they are always
# collected, and a missing package fails them.
if torch.cuda.is_available() and any(importlib.util.find_spec(n) is None for n in ("fastapi", "uvicorn", "openai")):
    collect_ignore = [f"server/{p.name}" for p in (Path(__file__).parent / "server").glob("test_*.py")
                      if p.name != "test_soak.py"]

ARCH_OVERRIDES = {
    "llama": {},
    "llama3-scaled": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"tie_word_embeddings": True},
    "llama-mqa": {"num_key_value_heads": 1},
    # one decoder layer: for the engine tests whose cost is the interpreted Triton kernels (a launch
    # per layer each step) and whose subject is not the stack of layers (the static decode path,
    # overlap, verify steps, FP8 pages and producers)
    "llama-1layer": {"num_hidden_layers": 1},
    "mistral-sw": {"sliding_window": 8},          # a window shorter than the prompts
    "mixtral": {},
    "qwen2moe": {},                               # a shared expert; top-k weights not renormalised
    "qwen2moe-step2": {"decoder_sparse_step": 2},  # layer 0 dense, layer 1 sparse
    "qwen3moe": {"norm_topk_prob": True, "num_experts": 16, "num_experts_per_tok": 4},
    "qwen3moe-dense0": {"mlp_only_layers": [0]},
    "deepseekv2": {},                             # V2-Lite's layout: q_proj, greedy softmax routing
    "deepseekv2-1layer": {"num_hidden_layers": 1},  # its dense layer alone: the latent cache's interpreted tests
    "deepseekv2-grouped": {"q_lora_rank": 48, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                           "routed_scaling_factor": 1.5},
    "deepseekv3": {},                             # sigmoid + score bias, groups by top-2 sums, interleaved rope
    "deepseekv3-yarn": {"rope_interleave": False, "first_k_dense_replace": 0, "n_shared_experts": 2,
                        "max_position_embeddings": 512,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 128, "beta_fast": 32,
                                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}},
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            arch = name.split("-")[0].replace("llama3", "llama")
            shard = "60KB" if name == "mistral" else None   # exercise the sharded-index path
            cache[name] = make_random_checkpoint(str(root / name), arch=arch, max_shard_size=shard,
                                                 **ARCH_OVERRIDES.get(name, {}))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_llm(checkpoints):
    from ridge import LLM
    return LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=512)


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist only the workers collect, and xdist sets their numprocesses to None: a
    # worker is told by the workerinput that xdist gives its config.
    if hasattr(config, "workerinput"):
        # the modules that hold a `slow` test go first, each kept whole (its module fixtures are
        # built once a worker): the long tests start while the short ones can still fill the other
        # worker, instead of one long test running alone at the end
        slow = {item.module for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.module not in slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server(checkpoints):
    """The tiny checkpoint served on loopback (tests/server_support.py), one server per test module."""
    from tests.server_support import serve_tiny
    yield from serve_tiny(checkpoints)
