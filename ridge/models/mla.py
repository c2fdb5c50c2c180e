"""DeepSeek-V2/V3's attention block: Multi-head Latent Attention's projections around the
attention step (ridge/layers/mla.py). Module and parameter names are the checkpoints'.

    q      = q_proj(x)                                  (q_lora_rank None: V2-Lite)
           | q_b_proj(q_a_layernorm(q_a_proj(x)))       (V2, V3)
    c, k_pe = kv_a_proj_with_mqa(x) split [kv_lora_rank, rope_dim];  c = kv_a_layernorm(c)
    out    = o_proj(attention(q, c, k_pe; kv_b_proj))   (kv_b_proj: the latent's up-projection)

The checkpoints lay the rotary dims out in interleaved pairs (x0, x1), (x2, x3), ... (V2; V3 with
rope_interleave): at load the rows that produce q's and k_pe's rotary parts are permuted to the
half-split layout ridge rotates (pair i -> dims i and i + rope/2). q and k move alike, so q.k is
unchanged, and one rotary kernel serves every model.

Quantized (`quant`), every projection but kv_b_proj takes the method: kv_b stays in the model's
dtype because the absorbed decode reads it split per head, folded into the query and the output
(ridge/layers/mla.py), not as one GEMM. A quantized projection's rows are permuted in whatever
form its method stores them (Linear.permute_outputs).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.model_config import ModelConfig
from ridge.kernels.attention_meta import AttentionMetadata
from ridge.layers.attention import AttentionBackend
from ridge.layers.cost import OpCost, StepShape, child
from ridge.layers.linear import Linear
from ridge.layers.mla import LatentAttention
from ridge.layers.norm import RMSNorm
from ridge.layers.quant.base import QuantConfig
from ridge.layers.rotary import RotaryEmbedding


def deinterleave(rows: int) -> torch.Tensor:
    """The permutation taking interleaved pairs to halves: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))


class MLAttention(nn.Module):
    input_proj = None       # two projections read the input (q and the latent's): no norm feeds one

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantConfig | None = None):
        super().__init__()
        m, H = cfg.mla, cfg.num_heads
        self.cfg, self.mla = cfg, m
        q_out = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_out, quant=quant)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, bias=cfg.o_bias, quant=quant)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)      # transformers' fixed eps
            self.q_b_proj = Linear(m.q_lora_rank, q_out, quant=quant)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.o_bias,
                                         quant=quant)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(H * m.v_head_dim, cfg.hidden_size, bias=cfg.o_bias, quant=quant)
        self.attn = LatentAttention(H, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                    m.softmax_scale, rotary, backend)

    def finish_loading(self) -> None:
        """Interleaved rotary rows -> half-split (module docstring)."""
        m = self.mla
        if not m.rope_interleaved:
            return
        nope, rope, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        perm = deinterleave(rope)
        q = self.q_proj if m.q_lora_rank is None else self.q_b_proj
        head = torch.cat((torch.arange(nope), nope + perm))
        q_rows = torch.cat([h * (nope + rope) + head for h in range(self.cfg.num_heads)])
        kv_rows = torch.cat((torch.arange(r), r + perm))
        for proj, rows in ((q, q_rows), (self.kv_a_proj_with_mqa, kv_rows)):
            proj.permute_outputs(rows)

    def _latent(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed latent [T, r], k_pe [T, rope]) of x's rows: what the cache holds of them."""
        m = self.mla
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent.contiguous()), k_pe

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        m, H = self.mla, self.cfg.num_heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        out = self.attn(positions, q.view(-1, H, m.qk_nope_head_dim + m.qk_rope_head_dim), *self._latent(x),
                        self.kv_b_proj.weight, kv_cache, meta)
        return self.o_proj(out.reshape(-1, H * m.v_head_dim))

    def write_kv(self, positions, x, kv_cache, slot_mapping: torch.Tensor) -> None:
        """The cache entries of x's rows, without the query or attending (LatentAttention.write_kv)."""
        self.attn.write_kv(positions, *self._latent(x), kv_cache, slot_mapping)

    def cost(self, step: StepShape) -> list[OpCost]:
        T, m = step.num_tokens, self.mla
        if m.q_lora_rank is None:
            out = child("q_proj", self.q_proj.cost(step, name="q_proj"))
        else:
            out = (child("q_a_proj", self.q_a_proj.cost(step, name="q_a_proj"))
                   + child("q_a_layernorm", self.q_a_layernorm.cost(step, T), "q_a_norm")
                   + child("q_b_proj", self.q_b_proj.cost(step, name="q_b_proj")))
        return (out + child("kv_a_proj_with_mqa", self.kv_a_proj_with_mqa.cost(step, name="kv_a_proj"))
                + child("kv_a_layernorm", self.kv_a_layernorm.cost(step, T), "kv_a_norm")
                + child("attn", self.attn.cost(step, self.kv_b_proj.weight.nbytes))
                + child("o_proj", self.o_proj.cost(step, name="o_proj")))
