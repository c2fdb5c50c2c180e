"""AWQ (activation-aware weight quantization, Lin et al. 2023) for the Llama family.

The idea: a few input channels carry large activations, and the rounding error of the weights
they multiply dominates the output error. Scaling such a column of W up by s before quantizing
(and its input down by s) gives it relatively finer levels; the input's 1/s is folded into the
op before the Linear, so the model computes the same function and nothing runs at inference.

Per Linear (W [N, K], calibration input statistics: mean |x| and H = x^T x / T, see calib.py):
  * scale search: s = mean|x|^alpha (normalised to geometric mean 1), alpha on a grid of
    N_GRID points in [0, 1); the objective is the layer's own output error on the calibration
    tokens, || Q(W diag(s)) diag(s)^-1 x - W x ||^2 = sum((E H) * E), E the effective weight error.
    alpha = 0 is s = 1, plain RTN: the search can only match or beat RTN in this objective.
  * clipping search (AutoAWQ's auto_clip): per (output row, group) a shrink r of the group's range
    on a grid down to 1 - MAX_SHRINK, chosen on that group's own share of the output error; the
    combination is kept only if the whole layer's objective improves (the groups' errors are not
    independent), so clipping never makes it worse either. Not for q and k (AutoAWQ's reason:
    their error is seen through the q.k product, which the layer's own output does not measure).

Where each scale is folded (exactly, so the unquantized model's outputs do not change):
  qkv_proj     1/s into input_layernorm's weight (RMSNorm(x) * w: a per-channel multiply)
  gate_up_proj 1/s into post_attention_layernorm's weight
  down_proj    1/s into up_proj's rows: down's input is silu(gate) * up, linear in up
  o_proj       1/s into v_proj's rows: attention output = softmax(qk) v, linear in v. With GQA
               one v row serves every query head of its group, so the scale is tied across those
               heads (one per kv head and dimension; mean|x| pooled over the tied channels) --
               AutoAWQ skips o_proj under GQA; a tied scale is still exact and the search still
               includes s = 1.
A v or up bias is divided by the same 1/s. Scaling v's or up's rows after their own layer's
scale search changes nothing there: the quantization grid is per row and group, so multiplying
a row by c > 0 multiplies its scales by c and leaves its q and zero points as they were.
Every layer's statistics come from the unquantized model (as AutoAWQ's do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.layers.quant.registry import checkpoint_format

INT4 = checkpoint_format("int4")         # the grid quantization at load uses

N_GRID = 20          # alpha = 0, 1/20, ..., 19/20 (AutoAWQ's grid)
MAX_SHRINK = 0.5     # clipping ratios 1, 0.95, ..., 0.55 (AutoAWQ's auto_clip)
CLIP_GRID = 20
_MIN_SCALE = 1e-4


def clip_weight(w: torch.Tensor, group_size: int, clip: torch.Tensor | None) -> torch.Tensor:
    """w with each (row, group) clamped to its range shrunk by the ratio clip[row, group]: the
    asymmetric min-max grid then spans [lo * r, hi * r] (lo <= 0 <= hi, as quantize_rtn's range),
    finer levels for the many values inside at the cost of the few clamped."""
    if clip is None:
        return w
    n, k = w.shape
    g = _grouped(w.float(), group_size)
    lo, hi = g.amin(-1).clamp(max=0) * clip, g.amax(-1).clamp(min=0) * clip
    return torch.maximum(torch.minimum(g, hi[..., None]), lo[..., None]).reshape(n, -1)[:, :k]


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, ceil(K / G), G], a short last group padded with zeros: quantize_rtn's groups
    (zeros leave a range that holds 0 as it is, and add nothing to an error)."""
    return torch.nn.functional.pad(t, (0, -t.shape[1] % group_size)).reshape(t.shape[0], -1, group_size)


def fake_quantize(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None,
                  scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float32 weight a reader of the checkpoint computes with: clip, round to nearest
    (ridge/layers/quant/int4/formats.py, the same function as quantization at load), dequantize."""
    return INT4.dequantize(*INT4.quantize_rtn(clip_weight(w, group_size, clip), group_size, scale_dtype), group_size)


def output_error(w_eff: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    """Mean over calibration tokens of ||(w_eff - w) x||^2: sum((E H) * E), H = x^T x / T."""
    e = (w_eff.float() - w.float())
    return float(((e @ h) * e).sum())


def _expand_tied(v: torch.Tensor, tie: int, width: int) -> torch.Tensor:
    """[K / tie] pooled values back to [K]: channel (h, d) of head h takes the value of its kv
    head h // tie, dimension d (o_proj's input is heads x head_dim, query heads in kv-head order)."""
    kv = v.reshape(-1, 1, width)
    return kv.expand(-1, tie, width).reshape(-1)


def pool_tied(x: torch.Tensor, tie: int, width: int) -> torch.Tensor:
    """[K] per-channel values -> [K / tie], the mean over the `tie` query heads of each kv head."""
    return x.reshape(-1, tie, width).mean(1).reshape(-1)


@dataclass
class ScaleResult:
    scale: torch.Tensor          # [K]: W is stored as W diag(s), the input divided by s upstream
    alpha: float
    error: float                 # the objective at the chosen scale
    rtn_error: float             # the objective at s = 1


@torch.no_grad()
def search_scale(w: torch.Tensor, mean_abs: torch.Tensor, h: torch.Tensor, group_size: int,
                 scale_dtype: torch.dtype = torch.float32, tie: tuple[int, int] | None = None,
                 n_grid: int = N_GRID) -> ScaleResult:
    """The per-input-channel scale minimising the layer's output error (module docstring).
    `tie` = (query heads per kv head, head_dim): one scale per kv head and dimension."""
    w = w.float()
    x = pool_tied(mean_abs, *tie) if tie else mean_abs.float()
    best = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = x.clamp(min=_MIN_SCALE).pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=_MIN_SCALE)
        if tie:
            s = _expand_tied(s, *tie)
        err = output_error(fake_quantize(w * s, group_size, scale_dtype=scale_dtype) / s, w, h)
        if i == 0:
            rtn = err
        if best is None or err < best.error:
            best = ScaleResult(s, alpha, err, rtn)
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, h: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32,
                rows: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per (row, group) clipping ratios [N, ceil(K / group_size)] for the (already scaled) weight w, or
    None where no clipping lowers the layer's objective. `rows` (bool [N]): the rows that may clip;
    `input_scale`: the s that w was scaled by (the error is measured on the original input)."""
    w = w.float()
    n, k = w.shape
    g = -(-k // group_size)
    inv = 1.0 / input_scale if input_scale is not None else torch.ones(k, device=w.device)
    # the diagonal blocks of H: a group's own share of the output error (H padded with zeros to
    # whole groups: a short last group's block is its own rows and columns)
    hp = torch.nn.functional.pad(h, (0, g * group_size - k, 0, g * group_size - k))
    blocks = torch.stack([hp[j * group_size:(j + 1) * group_size, j * group_size:(j + 1) * group_size]
                          for j in range(g)])
    w_true = w * inv

    def group_errors(w_q):
        e = _grouped((w_q - w) * inv, group_size)
        return torch.einsum("ngk,gkl,ngl->ng", e, blocks, e)

    ones = torch.ones(n, g, device=w.device)
    best_err, best_ratio = group_errors(fake_quantize(w, group_size, scale_dtype=scale_dtype)), ones.clone()
    for i in range(1, int(MAX_SHRINK * CLIP_GRID)):
        ratio = 1 - i / CLIP_GRID
        err = group_errors(fake_quantize(w, group_size, ones * ratio, scale_dtype))
        better = err < best_err
        if rows is not None:
            better &= rows[:, None]
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    if bool((best_ratio == 1).all()):
        return None
    before = output_error(fake_quantize(w, group_size, scale_dtype=scale_dtype) * inv, w_true, h)
    after = output_error(fake_quantize(w, group_size, best_ratio, scale_dtype) * inv, w_true, h)
    return best_ratio if after < before else None
