"""Random-weight HF checkpoints written by transformers itself: the test models and the shapes
the benchmarks run (no weights can be downloaded, and the oracle must be transformers).

    python -m ridge.utils.random_checkpoint OUT_DIR --arch llama --preset tiny
    python -m ridge.utils.random_checkpoint OUT_DIR --preset llama3-8b --config-only

--config-only writes config.json and the tokenizer, no weights: what an engine started with
load_format="dummy" reads, so a benchmark-sized model starts without writing its weights to disk.
"""
from __future__ import annotations

import argparse
import os

import torch

PRESETS = {
    # a few hundred thousand parameters: CPU tests in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    # every projection's inputs a multiple of 128: INT4 groups of 64 or 128 (tests of the INT4 formats)
    "tiny-g128": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # tensor parallelism's benchmark shape (--config-only, dummy weights: 141 GB of bf16)
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
                       rope_theta=1000000.0, tie_word_embeddings=True),
    # mixture-of-experts benchmark shapes (with --arch qwen3moe / mixtral)
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
    # DeepSeek-V2-Lite's shape (with --arch deepseekv2): 15.7 B parameters, 2.4 B active
    "deepseek-v2-lite": dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                             vocab_size=102400, max_position_embeddings=163840, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                             num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                             first_k_dense_replace=1, rope_parameters=dict(
                                 rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
                         num_local_experts=8, num_experts_per_tok=2),
}

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseekv2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseekv3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
_DEEPSEEK = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
# experts of the small presets, per MoE architecture (a preset's own values win)
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96),
    "qwen3moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    # V2-Lite's layout (no q bottleneck, greedy routing); V3's (q bottleneck, 4 groups, 2 kept)
    "deepseekv2": dict(_DEEPSEEK, q_lora_rank=None),
    "deepseekv3": dict(_DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TOKENIZER_TEXT = (
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    "The quick brown fox jumps over the lazy dog. Hello, world! import os, sys\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
)


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained in milliseconds on a fixed text: every string encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def make_random_checkpoint(out_dir: str, arch: str = "llama", preset: str = "tiny", dtype=torch.float32,
                           seed: int = 0, device: str = "cpu", max_shard_size: str | None = None,
                           with_tokenizer: bool = True, config_only: bool = False, **overrides) -> str:
    import transformers

    cfg_name, model_name = ARCHS[arch]
    kwargs = {**MOE_DEFAULTS.get(arch, {}), **PRESETS[preset]}
    kwargs.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch in ("qwen3", "qwen3moe"):
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if arch.startswith("deepseek"):         # every head reads the one latent: no kv-head groups
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    os.makedirs(out_dir, exist_ok=True)
    if with_tokenizer:
        make_tokenizer(config.vocab_size).save_pretrained(out_dir)
    if config_only:
        config.architectures, config.dtype = [model_name], dtype   # as save_pretrained of the model writes
        config.save_pretrained(out_dir)
        return out_dir
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_name)(config)
    finally:
        torch.set_default_dtype(default)
    if arch in ("qwen2", "qwen2moe", "deepseekv3"):
        # transformers initialises biases (and V3's expert score bias) to zero; random ones make the
        # bias path matter in tests
        with torch.no_grad():
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="config.json and tokenizer, no weights "
                    "(for load_format dummy)")
    a = ap.parse_args()
    make_random_checkpoint(a.out, a.arch, a.preset, getattr(torch, a.dtype), a.seed, a.device,
                           config_only=a.config_only)
    print(a.out)


if __name__ == "__main__":
    main()
