#!/usr/bin/env python
"""Train ridge's bundled demo model: a small Llama code model on the Python stdlib.

Data (see ``demo_data.py``)
    The ``.py`` files of the running interpreter's standard library, minus
    site-packages, test suites, idlelib, lib2to3, encodings, pydoc_data, etc.
    Held out for evaluation: files whose relative POSIX path has a SHA-1 hex
    digest starting with "0" or "1" (~1/8); the list is written to
    ``OUT/heldout_files.txt``. The stdlib differs between Python versions, so
    ``OUT/training_info.json`` records the Python version used.

Tokenizer
    Byte-level BPE (HF ``tokenizers``), vocab 8192, special tokens
    ``<|bos|>`` (0), ``<|eos|>`` (1), ``<|pad|>`` (2), trained on the training
    files only. ``tokenizer(text)`` prepends ``<|bos|>`` (TemplateProcessing
    post-processor) and adds no EOS. Each training document is
    ``<|bos|> file tokens <|eos|>``; documents are concatenated into one token
    stream and training samples are random windows of ``--seq-len`` tokens.
    Chat template: ``<|bos|>`` then per message ``<|role|>\\n{content}\\n<|eos|>``
    (role markers are plain text); the generation prompt is ``<|assistant|>\\n``.
    ``--tokenizer DIR`` reuses an existing tokenizer (so a draft model shares it).

Model (``transformers.LlamaForCausalLM``: RMSNorm, RoPE theta 1e4, SwiGLU, GQA,
tied embeddings, vocab 8192, max positions 2048, head_dim 64)
    main : hidden 384, 6 layers, 6 heads / 2 KV heads, MLP 896  -> ~11.7M params
    small: hidden 192, 4 layers, 3 heads / 1 KV head,  MLP 512  -> ~3.1M params
    Weights are saved in float32 if that fits the size limit (main 25 MB,
    small 8 MB), otherwise in bfloat16.

Training
    AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup then
    cosine decay to 10% of ``--lr``, grad clip 1.0, bf16 autocast on CUDA and
    fp32 on CPU. Deterministic data order and init given ``--seed`` (CUDA kernels
    may still add tiny run-to-run differences). ``--max-minutes`` stops the loop
    early (the LR schedule is not shortened). Held-out perplexity is token-level:
    the held-out documents are concatenated like the training stream and cut into
    non-overlapping ``--seq-len`` windows; BOS targets are not scored.

Example
    python scripts/train_demo_model.py --out ridge/assets/demo-code-12m
    python scripts/train_demo_model.py --out ridge/assets/demo-code-3m --size small \\
        --tokenizer ridge/assets/demo-code-12m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import demo_data  # noqa: E402

VOCAB_SIZE = 8192
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# the bundled models' template (tool calling included): one file, shipped beside each checkpoint
_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ridge", "assets", "demo-code-12m",
                         "chat_template.jinja")
with open(_TEMPLATE) as _f:
    CHAT_TEMPLATE = _f.read()
SIZES = {
    "main": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=2, intermediate_size=896),
    "small": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, intermediate_size=512),
}
SIZE_LIMIT_BYTES = {"main": 25_000_000, "small": 8_000_000}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)  # all training files: ~8 MB, a few seconds
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        chat_template=CHAT_TEMPLATE, model_max_length=2048, clean_up_tokenization_spaces=False)


def encode_docs(tokenizer, texts: list[str]) -> list[int]:
    """Concatenate documents as <|bos|> tokens <|eos|> (BOS comes from the post-processor)."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    stream = []
    for doc in ids:
        assert doc[0] == tokenizer.bos_token_id
        stream.extend(doc)
        stream.append(tokenizer.eos_token_id)
    return stream


def add_residual_dropout(model, p: float) -> None:
    """Dropout on what each attention and MLP block adds to the residual stream, active only in
    train mode. transformers' Llama has no such dropout; hooks add it without changing the
    architecture, so the saved checkpoint is a standard Llama."""
    if p <= 0:
        return

    def drop(module, inputs, output):
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, module.training),) + tuple(output[1:])
        return torch.nn.functional.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)


def build_model(size: str, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048, rope_theta=10000.0,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"], rms_norm_eps=1e-5,
        hidden_act="silu", tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape)
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch_size: int, device, bos_id: int,
             max_windows: int | None = None) -> tuple[float, int]:
    """Mean NLL (nats/token) and token count over non-overlapping windows of the stream."""
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    starts = list(range(0, n_win * seq_len, seq_len))
    if max_windows is not None and n_win > max_windows:  # evenly spaced subset
        starts = [starts[i * n_win // max_windows] for i in range(max_windows)]
    total_nll, total_tok = 0.0, 0
    for i in range(0, len(starts), batch_size):
        idx = torch.tensor(starts[i:i + batch_size])[:, None] + torch.arange(seq_len + 1)
        chunk = stream[idx].to(device)
        x, y = chunk[:, :-1], chunk[:, 1:].clone()
        y[y == bos_id] = -100
        with autocast(device):
            logits = model(input_ids=x).logits
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                              ignore_index=-100, reduction="sum")
        total_nll += nll.item()
        total_tok += int((y != -100).sum())
    model.train()
    return total_nll / max(1, total_tok), total_tok


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=False, help="output checkpoint directory")
    p.add_argument("--size", choices=sorted(SIZES), default="main")
    p.add_argument("--tokenizer", help="reuse the tokenizer in this directory")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=None, help="default: min(200, steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--stdlib", default=None,
                   help="standard-library tree to read (default: the running Python's)")
    p.add_argument("--include-tests", action="store_true",
                   help="also train and evaluate on the stdlib's test suite (Lib/test), where installed")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="training-only dropout on each attention and MLP output (the data is small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250, help="quick held-out eval (0: off)")
    p.add_argument("--eval-windows", type=int, default=None,
                   help="cap on held-out windows for the final eval (default: all)")
    p.add_argument("--heldout-only", action="store_true", help="list held-out files and exit")
    args = p.parse_args(argv)
    stdlib = os.path.abspath(args.stdlib) if args.stdlib else demo_data.stdlib_dir()
    tests = args.include_tests
    if args.heldout_only:
        print("\n".join(demo_data.read_files(stdlib, demo_data.heldout_files(stdlib, tests))[0]))
        return
    if not args.out:
        p.error("--out is required")

    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)

    # ---- data + tokenizer
    train_paths, train_texts = demo_data.read_files(stdlib, demo_data.train_files(stdlib, tests))
    eval_paths, eval_texts = demo_data.read_files(stdlib, demo_data.heldout_files(stdlib, tests))
    print(f"python {platform.python_version()} stdlib {stdlib}: "
          f"{len(train_paths)} train files, {len(eval_paths)} held-out files")
    t0 = time.time()
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        print(f"loaded tokenizer from {args.tokenizer}")
    else:
        tokenizer = train_tokenizer(train_texts)
        print(f"trained BPE tokenizer ({len(tokenizer)} tokens) in {time.time() - t0:.1f}s")
    train_stream = torch.tensor(encode_docs(tokenizer, train_texts), dtype=torch.long)
    eval_stream = torch.tensor(encode_docs(tokenizer, eval_texts), dtype=torch.long)
    eval_bytes = sum(len(t.encode("utf-8")) for t in eval_texts)
    print(f"tokens: train {len(train_stream):,}, held-out {len(eval_stream):,} "
          f"({sum(len(t.encode()) for t in train_texts) / len(train_stream):.2f} bytes/token)")
    with open(os.path.join(args.out, "heldout_files.txt"), "w") as fh:
        fh.write("\n".join(eval_paths) + "\n")

    # ---- model + optimizer
    model = build_model(args.size, tokenizer).to(device)
    add_residual_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model '{args.size}': {n_params:,} parameters ({n_params / 1e6:.2f}M), "
          f"config {SIZES[args.size]}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    warmup = args.warmup if args.warmup is not None else max(1, min(200, args.steps // 10))

    # ---- training loop
    gen = torch.Generator().manual_seed(args.seed)
    max_start = len(train_stream) - args.seq_len - 1
    offsets = torch.arange(args.seq_len + 1)
    curve, eval_curve, recent = [], [], []
    t_train = time.time()
    model.train()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, mininterval=2.0)
    step = 0
    for step in bar:
        lr = lr_at(step, args.steps, warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, max_start + 1, (args.batch_size,), generator=gen)
        chunk = train_stream[starts[:, None] + offsets].to(device, non_blocking=True)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with autocast(device):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        loss_v = loss.item()
        recent = (recent + [loss_v])[-50:]
        bar.set_postfix(loss=f"{loss_v:.3f}", lr=f"{lr:.2e}", refresh=False)
        if (step + 1) % args.log_every == 0 or step == 0:
            curve.append([step + 1, round(sum(recent) / len(recent), 4)])
            tqdm.write(f"step {step + 1:6d}  loss {curve[-1][1]:.4f}  lr {lr:.2e}  "
                       f"{(step + 1) * args.batch_size * args.seq_len / (time.time() - t_train):,.0f} tok/s")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            nll, _ = evaluate(model, eval_stream, args.seq_len, args.batch_size, device,
                              tokenizer.bos_token_id, max_windows=64)
            eval_curve.append([step + 1, round(nll, 4)])
            tqdm.write(f"step {step + 1:6d}  held-out loss {nll:.4f} (64 windows)  ppl {math.exp(nll):.2f}")
        if args.max_minutes is not None and time.time() - t_train > args.max_minutes * 60:
            tqdm.write(f"--max-minutes {args.max_minutes} reached after {step + 1} steps")
            break
    bar.close()
    steps_done = step + 1
    train_seconds = time.time() - t_train
    final_train_loss = sum(recent) / len(recent)

    nll, n_eval_tok = evaluate(model, eval_stream, args.seq_len, args.batch_size, device,
                               tokenizer.bos_token_id, max_windows=args.eval_windows)
    eval_curve.append([steps_done, round(nll, 4)])
    ppl = math.exp(nll)
    full_eval = args.eval_windows is None
    bpb = nll * n_eval_tok / math.log(2) / eval_bytes if full_eval else None  # ~: EOS scored, tail cut
    print(f"final train loss {final_train_loss:.4f} | held-out loss {nll:.4f}  ppl {ppl:.2f}"
          + (f"  bits/byte {bpb:.3f}" if bpb else "") + f"  ({n_eval_tok:,} tokens)")

    # ---- save
    from transformers import GenerationConfig
    limit = SIZE_LIMIT_BYTES[args.size]
    save_dtype = torch.float32 if n_params * 4 <= limit else torch.bfloat16
    model = model.to("cpu", dtype=save_dtype)
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(args.out)
    if not args.tokenizer:
        tokenizer.save_pretrained(args.out)
    elif os.path.abspath(args.tokenizer) != os.path.abspath(args.out):
        # copy the files: the draft model shares the tokenizer byte for byte
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(args.tokenizer, name)):
                shutil.copyfile(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    st_path = os.path.join(args.out, "model.safetensors")
    os.chmod(st_path, 0o644)  # save_pretrained may leave it 0600
    st_size = os.path.getsize(st_path)
    print(f"saved {args.out} ({str(save_dtype).split('.')[-1]}, model.safetensors "
          f"{st_size / 1e6:.2f} MB)")
    if st_size > limit:
        print(f"WARNING: model.safetensors exceeds the {limit / 1e6:.0f} MB limit")

    info = {
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "size": args.size,
        "parameters": n_params,
        "model_shape": SIZES[args.size],
        "saved_dtype": str(save_dtype).split(".")[-1],
        "safetensors_bytes": st_size,
        "seed": args.seed,
        "steps_requested": args.steps,
        "steps": steps_done,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "dropout": args.dropout,
        "include_tests": args.include_tests,
        "stdlib": stdlib,
        "warmup": warmup,
        "train_tokens_seen": steps_done * args.batch_size * args.seq_len,
        "final_train_loss": round(final_train_loss, 4),
        "heldout_loss": round(nll, 4),
        "heldout_perplexity": round(ppl, 3),
        "heldout_bits_per_byte": round(bpb, 4) if bpb else None,
        "heldout_eval_tokens": n_eval_tok,
        "heldout_split_rule": "sha1(relative posix path).hexdigest()[0] in '01'",
        "train_files": len(train_paths),
        "eval_files": len(eval_paths),
        "train_tokens": len(train_stream),
        "eval_tokens": len(eval_stream),
        "tokenizer": args.tokenizer or "trained on the training files",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "loss_curve": curve,
        "heldout_loss_curve": eval_curve,
    }
    with open(os.path.join(args.out, "training_info.json"), "w") as fh:
        json.dump(info, fh, indent=2)

    # ---- verify the checkpoint loads, and sample
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok2 = AutoTokenizer.from_pretrained(args.out)
    model2 = AutoModelForCausalLM.from_pretrained(args.out).eval()
    assert tok2("x")["input_ids"][0] == tok2.bos_token_id
    prompt = "def fibonacci(n):"
    enc = tok2(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model2.generate(**enc, max_new_tokens=48, do_sample=False)
    print("greedy sample:\n" + tok2.decode(out[0], skip_special_tokens=True))
    print(f"done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
