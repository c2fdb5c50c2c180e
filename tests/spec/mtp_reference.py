"""DeepSeek-V3 MTP layers for tests, independent of ridge's code: a random MTP layer added to a
transformers DeepSeek-V3 checkpoint in the public layout (`model.layers.{L}.*`: enorm, hnorm,
eh_proj, a decoder layer shaped as layer L - 1, shared_head.norm, shared_head.head and a copy of the
embedding), and the layer's forward over whole histories with no cache: enorm/hnorm/eh_proj and
the shared head in plain torch off those tensors, the decoder layer transformers' own
(DeepseekV3DecoderLayer, loaded by transformers as layer L of a model one layer deeper), fed the
target's final normed states from transformers."""
import json
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tests.spec.eagle3_reference import ReferenceHead


def write_mtp_layer(target: str, seed: int = 0, std: float = 0.15, echo: float = 0.0) -> str:
    """Add an MTP layer to the single-file checkpoint `target` in place. Random (never zero) by
    default. `echo` in (0, 1]: a layer whose drafts the target often accepts (random ones hardly
    ever are): eh_proj passes echo x the embedding of token p + 1 plus (1 - echo) x the state at p
    through, the decoder layer's weights are tiny and the head is the target's LM head. A tiny
    random target's state is mostly its last token's embedding, so its logits then mix the
    target's own predictions at p + 1 (the right position) and at p (one late)."""
    cfg = json.load(open(os.path.join(target, "config.json")))
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    path = os.path.join(target, "model.safetensors")
    with safe_open(path, "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}

    def rand(*shape, scale=std):
        return scale * torch.randn(*shape, generator=g)

    def norm(*shape):
        return 1 + rand(*shape, scale=0.02 if echo else 0.1)
    p, layer_std = f"model.layers.{L}.", 1e-3 if echo else std
    for k in [k for k in w if k.startswith(f"model.layers.{L - 1}.")]:
        t, name = w[k], k.split(".", 3)[3]
        w[p + name] = (norm(t.shape) if "norm" in name else rand(t.shape, scale=layer_std)).to(t.dtype)
    eh = rand(H, 2 * H, scale=layer_std)
    if echo:
        eh += torch.cat([echo * torch.eye(H), (1 - echo) * torch.eye(H)], 1)
    w.update({p + "enorm.weight": norm(H), p + "hnorm.weight": norm(H), p + "eh_proj.weight": eh,
              p + "shared_head.norm.weight": norm(H),
              p + "shared_head.head.weight": w["lm_head.weight"].clone() if echo else rand(V, H),
              p + "embed_tokens.weight": w["model.embed_tokens.weight"].clone()})
    save_file(w, path, metadata={"format": "pt"})
    return target


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceMTP:
    """The MTP layer of the checkpoint at `target` in float32, run over whole histories."""

    def __init__(self, target: str):
        import transformers
        cfg = json.load(open(os.path.join(target, "config.json")))
        L, self.eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
        deeper = transformers.AutoModelForCausalLM.from_pretrained(target, num_hidden_layers=L + 1,
                                                                   attn_implementation="eager")
        self.layer, self.rotary = deeper.model.layers[L].float().eval(), deeper.model.rotary_emb
        with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
            self.w = {k.split(".", 3)[3]: f.get_tensor(k).float() for k in f.keys()
                      if k.startswith(f"model.layers.{L}.") and not k.split(".", 3)[3].startswith(
                          ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))}

    @torch.no_grad()
    def run(self, next_ids: list[int], positions: list[int], states: torch.Tensor):
        """Rows p: (token p + 1, position p, the state at p [H]) -> (logits [T, vocab], pre [T, H])."""
        w, eps, T = self.w, self.eps, len(next_ids)
        e = F.embedding(torch.tensor(next_ids), w["embed_tokens.weight"])
        h = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(states.float(), w["hnorm.weight"], eps)], -1)
        h = (h @ w["eh_proj.weight"].T)[None]
        pos = torch.tensor(positions)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        pre = self.layer(h, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(h, pos))[0]
        return _rms(pre, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T, pre

    @staticmethod
    def fuse(states: torch.Tensor) -> torch.Tensor:
        return states                   # the layer reads the target's states as they are

    # greedy drafts after the tokens from scratch, as an EAGLE-3 head's (the same chaining)
    drafts = ReferenceHead.drafts


def target_states(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' final normed hidden states of `tokens` [n, H] (what the LM head reads)."""
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]
