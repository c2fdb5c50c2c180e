"""EAGLE-3 heads for tests, independent of ridge's code: a random head written in the public
checkpoint layouts (the original EAGLE-3 one: `midlayer.*`, no embedding, d2t/t2d; the
speculators one: `layers.0.*`, its own embedding, an fc bias, norm_before_residual, the Llama keys
nested), and the head's forward in plain torch read off those tensors (docs/eagle3-design.md §3),
over whole histories with no cache, with the target's states from transformers."""
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HEAD_SHAPE = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def write_head(out: str, target: str, layout: str = "eagle", draft_vocab: int = 384, aux=(1, 2, 3),
               seed: int = 0, std: float = 0.15) -> str:
    """A random one-layer head for the transformers checkpoint `target`; draft ids map to a random
    sorted subset of the target's vocabulary (d2t[i] = used[i] - i, t2d its mask, as EAGLE builds
    them). std 0.15: peaked enough that drafts are not uniform noise."""
    tcfg = json.load(open(os.path.join(target, "config.json")))
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    I, heads, kv = HEAD_SHAPE["intermediate_size"], HEAD_SHAPE["num_attention_heads"], HEAD_SHAPE["num_key_value_heads"]
    d = H // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1 + torch.randn(H, generator=g) * 0.1
    p = "midlayer." if layout == "eagle" else "layers.0."
    used = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    w = {"fc.weight": rand(H, len(aux) * H), p + "hidden_norm.weight": norm(), p + "input_layernorm.weight": norm(),
         p + "self_attn.q_proj.weight": rand(heads * d, 2 * H), p + "self_attn.k_proj.weight": rand(kv * d, 2 * H),
         p + "self_attn.v_proj.weight": rand(kv * d, 2 * H), p + "self_attn.o_proj.weight": rand(H, heads * d),
         p + "post_attention_layernorm.weight": norm(), p + "mlp.gate_proj.weight": rand(I, H),
         p + "mlp.up_proj.weight": rand(I, H), p + "mlp.down_proj.weight": rand(H, I), "norm.weight": norm(),
         "lm_head.weight": rand(draft_vocab, H), "d2t": used - torch.arange(draft_vocab),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)}
    llama = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=heads,
                 num_key_value_heads=kv, vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-6,
                 rope_theta=10000.0, model_type="llama", tie_word_embeddings=False)
    if layout == "eagle":
        cfg = dict(llama, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab, target_hidden_size=H,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True})
    else:
        with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
            w["embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
        w["fc.bias"] = rand(H)
        cfg = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", transformer_layer_config=llama,
                   draft_vocab_size=draft_vocab, target_hidden_size=H, norm_before_residual=True,
                   eagle_aux_hidden_state_layer_ids=list(aux))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out, "model.safetensors"))
    return out


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """HF Llama's rotate-half rotary embedding of x [T, heads, d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class ReferenceHead:
    """The head read off its checkpoint files; `embed`: the target's table unless it has its own."""

    def __init__(self, head_dir: str, target_embed: torch.Tensor):
        with safe_open(os.path.join(head_dir, "model.safetensors"), "pt") as f:
            self.w = {k.replace("midlayer.", "layers.0."): f.get_tensor(k).float() for k in f.keys()}
        cfg = json.load(open(os.path.join(head_dir, "config.json")))
        self.before = bool(cfg.get("norm_before_residual", False))
        self.embed = self.w.get("embed_tokens.weight", target_embed.detach())
        self.vocab, self.heads, self.kv = target_embed.shape[0], HEAD_SHAPE["num_attention_heads"], \
            HEAD_SHAPE["num_key_value_heads"]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux @ self.w["fc.weight"].T + self.w.get("fc.bias", 0)

    def run(self, ids: list[int], positions: list[int], states: torch.Tensor):
        """Rows in order, each attending to itself and the rows before it (what the head's cache
        holds when it decodes them one after another): (logits [T, vocab] over the target's ids,
        -inf off the draft vocabulary; pre [T, H])."""
        w, L = self.w, "layers.0."
        pos = torch.tensor(positions)
        e = _rms(self.embed[torch.tensor(ids)], w[L + "input_layernorm.weight"])
        if self.before:
            h = residual = _rms(states, w[L + "hidden_norm.weight"])
        else:
            residual, h = states, _rms(states, w[L + "hidden_norm.weight"])
        x = torch.cat([e, h], -1)
        T, d = x.shape[0], w[L + "self_attn.q_proj.weight"].shape[0] // self.heads
        q = _rope((x @ w[L + "self_attn.q_proj.weight"].T).view(T, self.heads, d), pos)
        k = _rope((x @ w[L + "self_attn.k_proj.weight"].T).view(T, self.kv, d), pos)
        v = (x @ w[L + "self_attn.v_proj.weight"].T).view(T, self.kv, d)
        k, v = (t.repeat_interleave(self.heads // self.kv, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1) @ w[L + "self_attn.o_proj.weight"].T
        h = residual + a
        m = _rms(h, w[L + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T))
        pre = h + m @ w[L + "mlp.down_proj.weight"].T
        draft = _rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T
        ids_t = torch.arange(draft.shape[1]) + w["d2t"].long()
        logits = torch.full((T, self.vocab), float("-inf")).index_copy_(1, ids_t, draft)
        return logits, pre

    def drafts(self, aux: torch.Tensor, tokens: list[int], k: int):
        """Greedy drafts after `tokens` (x_0 .. x_v) from scratch: rows p < v pair the target's
        state at p (aux [v, n H], from transformers) with token p + 1; then k - 1 chained rows,
        each fed the previous row's pre and draft. Returns (drafts, the top-2 margin of each)."""
        v = len(tokens) - 1
        ids, positions, states = tokens[1:], list(range(v)), self.fuse(aux[:v])
        out, margins = [], []
        for j in range(k):
            logits, pre = self.run(ids, positions, states)
            top = logits[-1].topk(2).values
            out.append(int(logits[-1].argmax()))
            margins.append(float(top[0] - top[1]))
            ids, positions, states = ids + [out[-1]], positions + [v + j], torch.cat([states, pre[-1:]])
        return out, margins


def target_states(hf_model, tokens: list[int], layer_ids=(1, 2, 3)) -> torch.Tensor:
    """transformers' hidden_states[i] (the stream entering layer i) of each id, side by side."""
    with torch.no_grad():
        hs = hf_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layer_ids], -1).float()


def write_echo_head(out: str, target: str) -> str:
    """A head whose draft distribution is the target's own at the previous position: its state is
    the target's stream after the last layer (aux id L, picked out by fc), its layer adds nothing
    (o_proj and down_proj zero), its final norm and LM head are the target's. A random head and a
    random target hardly ever agree; this one overlaps the target's distribution as much as two
    consecutive positions of it do, so sampled drafts are often accepted, and its id L exercises
    the capture after the last layer."""
    layers = json.load(open(os.path.join(target, "config.json")))["num_hidden_layers"]
    write_head(out, target, aux=(1, 2, layers))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
        norm, lm_head = f.get_tensor("model.norm.weight"), f.get_tensor("lm_head.weight")
    H = norm.shape[0]
    w["fc.weight"] = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1)
    w["midlayer.self_attn.o_proj.weight"].zero_()
    w["midlayer.mlp.down_proj.weight"].zero_()
    w["norm.weight"], w["lm_head.weight"] = norm, lm_head[torch.arange(w["d2t"].shape[0]) + w["d2t"]]
    save_file(w, os.path.join(out, "model.safetensors"))
    return out
