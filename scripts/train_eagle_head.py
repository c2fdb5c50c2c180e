#!/usr/bin/env python
"""Train an EAGLE-3 draft head for the bundled demo model (issue 44, item 2), on the CPU in minutes.

What is trained (docs/eagle3-design.md §3 and §7; the EAGLE-3 paper's recipe, as in SafeAILab/EAGLE's
``traineagle3`` and SpecForge)
    One decoder layer over the frozen target: g_t = fc([h_a, h_b, h_c]_t), the target's residual
    stream entering layers a < b < c (transformers' hidden_states[a, b, c]; --aux, default 1 3 5 of
    the 6), paired with the target's embedding of token t + 1 (shared, frozen, not saved), predicts
    token t + 2 through its own norm and an LM head over a draft vocabulary (the --draft-vocab most
    frequent tokens of the training stream; d2t and t2d as EAGLE's ``scandata`` builds them).

Training-time test (EAGLE-3's "TTT")
    Step 0 runs the head on the target's states; step i = 1..--ttt-1 feeds each row the head's own
    pre-norm output of step i - 1 at the same row (its features are the head's, as when it drafts),
    the teacher-forced token t + i + 1, at rotary position t + i; its attention sees step 0's keys up
    to t and its own row's keys of steps 1..i, which is what a chained draft step sees in the cache.

Loss
    Step i's cross-entropy against the target's own next-token distribution at position t + i + 1
    (restricted to the draft vocabulary), over rows whose target argmax is in it, weighted 0.8^i.
    Each step's top-1 agreement with the target's argmax is logged (EAGLE's ``acces``).

Data
    The demo corpus's training files only (``demo_data.train_files``: the stdlib with its tests, as
    the demo models were trained; a file whose path hashes into the held-out split, or is named in
    the target's heldout_files.txt, is never opened). Documents are ``<|bos|> tokens <|eos|>``
    concatenated; a batch is random windows of --seq-len + --ttt tokens (a seeded generator).

Output (the original EAGLE-3 layout, ``LlamaForCausalLMEagle3``: loads in ridge and in vLLM)
    OUT/config.json, OUT/model.safetensors (bfloat16: fc, midlayer.*, norm, lm_head, d2t, t2d),
    OUT/training_info.json (the command, data, time, loss and per-step accuracy curves).

    python scripts/train_eagle_head.py --out ridge/assets/demo-code-12m-eagle3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import demo_data  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "ridge", "assets", "demo-code-12m")
STEP_WEIGHT = 0.8                 # EAGLE-3's ploss_weight: later TTT steps count less


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Rope:
    """HF Llama's rotate-half rotary embedding, the tables for positions < n."""

    def __init__(self, d: int, n: int, theta: float):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
        ang = torch.arange(n).float()[:, None] * inv[None]
        self.cos, self.sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [B, heads, T, d] at positions start .. start + T - 1."""
        T, d = x.shape[2], x.shape[3]
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


class Head(nn.Module):
    """The head in training, its parameters named as the checkpoint names them (midlayer.*)."""

    def __init__(self, H: int, Ht: int, n_aux: int, inter: int, heads: int, kv: int, vd: int, eps: float):
        super().__init__()
        self.heads, self.kv, self.d, self.eps = heads, kv, H // heads, eps
        lin = lambda i, o: nn.Linear(i, o, bias=False)          # noqa: E731
        self.fc = lin(n_aux * Ht, H)
        m = self.midlayer = nn.Module()
        m.hidden_norm, m.input_layernorm, m.post_attention_layernorm = (nn.Parameter(torch.ones(H)) for _ in range(3))
        a = m.self_attn = nn.Module()
        a.q_proj, a.k_proj, a.v_proj = lin(2 * H, heads * self.d), lin(2 * H, kv * self.d), lin(2 * H, kv * self.d)
        a.o_proj = lin(heads * self.d, H)
        p = m.mlp = nn.Module()
        p.gate_proj, p.up_proj, p.down_proj = lin(H, inter), lin(H, inter), lin(inter, H)
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = lin(H, vd)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rope, start: int):
        """One step's layer input, queries, keys and values ([B, heads or kv, T, d]; rotary at start + t)."""
        m, (B, T, _) = self.midlayer, hidden.shape
        residual, g = hidden, rms(hidden, m.hidden_norm, self.eps)
        x = torch.cat([rms(embeds, m.input_layernorm, self.eps), g], -1)
        a = m.self_attn
        q = a.q_proj(x).view(B, T, self.heads, self.d).transpose(1, 2)
        k = a.k_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        v = a.v_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        rep = self.heads // self.kv
        return residual, rope(q, start), rope(k, start).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor):
        """(draft logits [B, T, vd], pre [B, T, H]) from the attention's output [B, heads, T, d]."""
        m, (B, T, _) = self.midlayer, residual.shape
        h = residual + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = rms(h, m.post_attention_layernorm, self.eps)
        pre = h + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
        return self.lm_head(rms(pre, self.norm, self.eps)), pre

    def unroll(self, aux: torch.Tensor, embeds: torch.Tensor, rope: Rope, steps: int) -> list[torch.Tensor]:
        """aux [B, T, n Ht]: the target's states at rows 0..T-1; embeds [B, T + steps - 1, H]: tokens
        1.. . Step i's logits at row t predict token t + i + 2 (as drafted i steps after row t)."""
        T, scale = aux.shape[1], self.d ** -0.5
        hidden, keys, vals, out = self.fc(aux), [], [], []
        mask = torch.ones(T, T, dtype=torch.bool, device=aux.device).triu(1)
        for i in range(steps):
            residual, q, k, v = self.qkv(embeds[:, i:i + T], hidden, rope, i)
            keys.append(k)
            vals.append(v)
            s0 = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(mask, float("-inf"))   # step 0: causal
            diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]               # own row, steps 1..i
            p = torch.cat([s0, *diag], -1).softmax(-1)
            attn = p[..., :T] @ vals[0]
            for j, vj in enumerate(vals[1:]):
                attn = attn + p[..., T + j:T + j + 1] * vj
            logits, hidden = self.finish(residual, attn)
            out.append(logits)
        return out


def training_stream(tokenizer, stdlib: str | None, include_tests: bool, heldout: set[str], max_files: int | None):
    """The training files' tokens as one stream (never a held-out file), and the files' count."""
    files = demo_data.train_files(stdlib, include_tests)
    files = [f for f in files if not demo_data.is_heldout(f) and f not in heldout][:max_files]
    kept, texts = demo_data.read_files(stdlib, files)
    stream = []
    for doc in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]:
        stream.extend(doc)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.int64), len(kept)


def draft_vocab(stream: torch.Tensor, vocab: int, vd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(used target ids sorted, d2t, t2d, the share of the stream's tokens they cover)."""
    counts = torch.bincount(stream, minlength=vocab)
    used = counts.topk(vd).indices.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True)
    return used, used - torch.arange(vd), t2d, float(counts[used].sum() / counts.sum())


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def head_config(tcfg: dict, a, vd: int) -> dict:
    llama = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id", "hidden_act") if k in tcfg}
    theta = tcfg.get("rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return dict(llama, architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                intermediate_size=a.intermediate_size, max_position_embeddings=tcfg["max_position_embeddings"],
                rope_theta=theta, tie_word_embeddings=False, draft_vocab_size=vd, target_hidden_size=tcfg["hidden_size"],
                eagle_aux_hidden_state_layer_ids=list(a.aux),
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(a.aux), "use_aux_hidden_state": True},
                torch_dtype="bfloat16")


def save(head: Head, d2t, t2d, cfg: dict, out: str) -> int:
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    # norms are bare parameters here; the checkpoint names every tensor <module>.weight
    w = {(k if k.endswith(".weight") else k + ".weight"): v.detach().to(torch.bfloat16).contiguous()
         for k, v in head.state_dict().items()}
    w["d2t"], w["t2d"] = d2t.contiguous(), t2d.contiguous()
    path = os.path.join(out, "model.safetensors")
    save_file(w, path, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return os.path.getsize(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET, help="the frozen target (a transformers Llama directory)")
    p.add_argument("--out", required=True)
    p.add_argument("--aux", type=int, nargs=3, default=[1, 3, 5], help="the target layers whose input stream is fused")
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--draft-vocab", type=int, default=4096, help="the most frequent training tokens (4096: 96%% of them)")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128, help="rows a window trains (plus --ttt tokens of lookahead)")
    p.add_argument("--ttt", type=int, default=4, help="training-time-test steps (1: no unroll)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop the loop early (the schedule is kept)")
    p.add_argument("--stdlib", default=None, help="the standard-library tree (default: this Python's)")
    p.add_argument("--no-tests", action="store_true", help="leave out the stdlib's test suite (the demo models used it)")
    p.add_argument("--max-files", type=int, default=None, help="at most this many training files (smoke runs)")
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.time()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False       # fp32 on both devices: one recipe
    tcfg = json.load(open(os.path.join(a.target, "config.json")))
    listed = os.path.join(a.target, "heldout_files.txt")
    heldout = set(open(listed).read().split()) if os.path.exists(listed) else set()
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    stream, n_files = training_stream(tokenizer, a.stdlib, not a.no_tests, heldout, a.max_files)
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    vd = min(a.draft_vocab, V)
    used, d2t, t2d, coverage = draft_vocab(stream, V, vd)
    print(f"{n_files} training files, {len(stream):,} tokens; draft vocabulary {vd} covers {coverage:.1%}")

    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(dev).eval().requires_grad_(False)
    used, t2d = used.to(dev), t2d.to(dev)
    embed = target.get_input_embeddings().weight
    head = Head(H, H, len(a.aux), a.intermediate_size, tcfg["num_attention_heads"], tcfg["num_key_value_heads"], vd,
                tcfg["rms_norm_eps"])
    with torch.no_grad():                 # start from the target's output space: its LM head (tied) and final norm
        lm = target.get_output_embeddings().weight
        head.lm_head.weight.copy_(lm[used])
        head.norm.copy_(target.model.norm.weight)
    head.to(dev)
    cfg = head_config(tcfg, a, vd)
    rope = Rope(H // tcfg["num_attention_heads"], a.seq_len + a.ttt, cfg["rope_theta"])
    rope.cos, rope.sin = rope.cos.to(dev), rope.sin.to(dev)
    decay = [p for n, p in head.named_parameters() if p.dim() == 2]
    rest = [p for n, p in head.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed)
    span, n = a.seq_len + a.ttt, a.ttt
    loss_curve, acc_curve, t0, step = [], [], time.time(), 0
    for step in range(a.steps):
        starts = torch.randint(0, len(stream) - span - 1, (a.batch_size,), generator=gen)
        ids = torch.stack([stream[s:s + span] for s in starts.tolist()]).to(dev)
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i][:, :a.seq_len] for i in a.aux], -1)
            logits = out.logits                                   # [B, span, V]: position p predicts p + 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.warmup, a.lr)
        steps_out = head.unroll(aux, embed[ids[:, 1:]], rope, n)
        loss, accs = 0.0, []
        for i, dl in enumerate(steps_out):
            tl = logits[:, i + 1:i + 1 + a.seq_len]               # the target's distribution of token t + i + 2
            best = tl.argmax(-1)
            mask = t2d[best].float()
            ce = -(tl[..., used].softmax(-1) * dl.log_softmax(-1)).sum(-1)
            loss = loss + STEP_WEIGHT ** i * (ce * mask).sum() / mask.sum().clamp(min=1)
            accs.append((used[dl.argmax(-1)] == best).float().mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if (step + 1) % a.log_every == 0 or step == 0 or step + 1 == a.steps:
            accs = [float(x) for x in accs]
            loss_curve.append([step + 1, round(loss.item(), 4)])
            acc_curve.append([step + 1, [round(x, 3) for x in accs]])
            print(f"step {step + 1:5d}  loss {loss.item():.4f}  acc/step {' '.join(f'{x:.3f}' for x in accs)}"
                  f"  {time.time() - t0:.0f}s", flush=True)
        if a.max_minutes is not None and time.time() - t0 > 60 * a.max_minutes:
            print(f"stopping at step {step + 1}: --max-minutes {a.max_minutes}")
            break
    train_s = time.time() - t0
    size = save(head.cpu(), d2t, t2d.cpu(), cfg, a.out)
    info = dict(command="python3 scripts/train_eagle_head.py " + " ".join(sys.argv[1:] if argv is None else argv),
                target=os.path.relpath(a.target, ROOT) if a.target.startswith(ROOT) else a.target,
                python_version=platform.python_version(), torch_version=torch.__version__,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                threads=torch.get_num_threads(), seed=a.seed, steps=step + 1, steps_requested=a.steps,
                batch_size=a.batch_size, seq_len=a.seq_len, ttt_steps=n, lr=a.lr, warmup=a.warmup,
                aux_layer_ids=list(a.aux), intermediate_size=a.intermediate_size, draft_vocab_size=vd,
                draft_vocab_coverage=round(coverage, 4), train_files=n_files, train_tokens=len(stream),
                include_tests=not a.no_tests, heldout_split_rule="sha1(relative posix path).hexdigest()[0] in '01' "
                "(never opened)", tokens_seen=(step + 1) * a.batch_size * a.seq_len,
                trainable_parameters=sum(p.numel() for p in head.parameters()), safetensors_bytes=size,
                train_seconds=round(train_s, 1), wall_seconds=round(time.time() - t_start, 1),
                loss_curve=loss_curve, step_accuracy_curve=acc_curve)
    with open(os.path.join(a.out, "training_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"saved {a.out} ({size / 1e6:.1f} MB) after {step + 1} steps in {train_s:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
