"""`run_roofline`: measure the ceilings, run real engine steps, diagnose them, predict, report.
At tensor_parallel_size N > 1 it only predicts (`predict_tensor_parallel`): the measured steps
time one process's kernels, so a step of N ranks is the cost model's rank share plus its
collectives at the link's roof, measured among N ranks where this machine has them."""
from __future__ import annotations

import datetime
import os

import torch

from ridge.config import EngineConfig, ModelConfig, model_dir, resolve_device, resolve_dtype
from ridge.layers.linear import Linear
from ridge.utils.ceilings import load_ceilings
from ridge.roofline.costs import PRECISIONS, RankShare, format_of, meta_model, parameter_bytes, step_costs
from ridge.roofline.diagnose import diagnose_step
from ridge.roofline.measure import build_decode, build_prefill, fill_kv_pool, release, time_engine_step
from ridge.roofline.predict import (DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_PRECISIONS, default_kv_budget,
                                    predict as predict_grid)
from ridge.roofline.report import Report, write_report

DEFAULT_LENGTH = 1024     # default decode context and prefill length, capped by the model's context



def model_weights(model: torch.nn.Module) -> int:
    """The parameter count a model card gives: each Linear's and each MoE layer's experts' weights
    however they are stored (an INT4 layer's packed words hold eight; quantized experts free their
    float copies), every other parameter as stored."""
    linears = [m for m in model.modules() if isinstance(m, Linear) or callable(getattr(m, "num_weights", None))]
    inside = {id(p) for m in linears for p in m.parameters()}
    return sum(m.num_weights() for m in linears) + sum(p.numel() for p in model.parameters() if id(p) not in inside)

def build_llm(model: str | None, batches, context: int, prefill_len: int, prefill_batch: int, **engine_kwargs):
    """An LLM sized for the roofline steps: seats, token budget, context and a KV pool just large
    enough for the largest step (steps run one after another). Prefix caching is off so that a
    prefill computes every token it is given."""
    from ridge import LLM
    path = model_dir(model)
    cfg = ModelConfig.from_dir(path)
    need_len = max(context if batches else 2, prefill_len + 1 if prefill_len else 2)
    if need_len > cfg.max_position_embeddings:
        raise ValueError(f"context/prefill_len: {need_len} tokens exceed the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    kw = dict(engine_kwargs)
    device = resolve_device(EngineConfig(device=kw.pop("device", "auto") or "auto").device)   # checked as set
    dtype = resolve_dtype(kw.pop("dtype", "auto") or "auto", cfg, device)
    bs = kw.pop("page_size", None) or 16
    max_b = max(batches, default=0)
    pages = max(max_b * -(-context // bs) if batches else 0, prefill_batch * -(-prefill_len // bs),
                -(-(need_len + 1) // bs)) + 1
    streams, heads, width = cfg.cache_row
    page_bytes = streams * cfg.num_layers * bs * heads * width * dtype.itemsize
    kv = kw.pop("kv_cache_memory", None) or pages * page_bytes
    kw.pop("enable_prefix_caching", None)
    kw.pop("model", None)
    max_len = max(kw.pop("max_model_len", None) or 0, need_len)
    seqs = max(kw.pop("max_num_seqs", None) or 1, max_b, prefill_batch)
    tokens = max(kw.pop("max_num_batched_tokens", None) or 1, max_b * context, prefill_batch * prefill_len)
    return LLM(path, dtype=str(dtype).removeprefix("torch."), device=str(device), max_model_len=max_len,
               max_num_seqs=seqs, max_num_batched_tokens=tokens, kv_cache_memory=kv, page_size=bs,
               enable_prefix_caching=False, show_progress=False, **kw)


def run_roofline(model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 batches=(1,), context: int | None = None, prefill_len: int | None = None, prefill_batch: int = 1,
                 reps: int = 5, warmup: int = 2, sampling: str = "greedy", predict: bool = False,
                 predict_batches=DEFAULT_BATCHES, predict_contexts=None, precisions=DEFAULT_PRECISIONS,
                 kv_budget: float | None = None, remeasure: bool = False, out: str | None = None, llm=None,
                 engine_kwargs: dict | None = None, command: str | None = None,
                 tensor_parallel_size: int = 1) -> Report:
    """Measure this device's ceilings (cached), time a real prefill step (`prefill_batch` prompts of
    `prefill_len` tokens; 0 skips it) and a decode step per batch size in `batches` (each sequence
    with `context` tokens of context; both lengths default to DEFAULT_LENGTH or the model's
    context), diagnose each op, optionally predict a grid of shapes and
    precisions, and write report.md/.json and roofline.png/.svg to `out`. tensor_parallel_size
    N > 1: the prediction alone (predict_tensor_parallel), which needs predict=True."""
    if tensor_parallel_size != 1:
        if not predict or llm is not None:
            raise ValueError("tensor_parallel_size: ridge roofline times one process's kernels; at N > 1 it "
                             "only predicts (--predict), from the cost of one rank's share and the link's roof")
        kw = {k: v for k, v in (engine_kwargs or {}).items() if k in ("page_size",)}
        return predict_tensor_parallel(model, tensor_parallel_size, device=device, dtype=dtype,
                                       batches=predict_batches, contexts=predict_contexts, precisions=precisions,
                                       kv_budget=kv_budget, remeasure=remeasure, out=out, sampling=sampling,
                                       command=command, **kw)
    if context is None or prefill_len is None:
        if llm is not None:
            max_pos = min(llm.engine.model_cfg.max_position_embeddings, llm.engine.cfg.max_model_len)
        else:
            max_pos = ModelConfig.from_dir(model_dir(model)).max_position_embeddings
        context = min(DEFAULT_LENGTH, max_pos) if context is None else context
        prefill_len = min(DEFAULT_LENGTH, max_pos - 1) if prefill_len is None else prefill_len
    if sampling not in ("greedy", "random"):
        raise ValueError(f"sampling: expected greedy or random, got {sampling!r}")
    batches = list(batches or [])
    for name, v in (("reps", reps), ("prefill_batch", prefill_batch), *(("batch", b) for b in batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    if not isinstance(prefill_len, int) or prefill_len < 0:
        raise ValueError(f"prefill_len: must be >= 0, got {prefill_len!r}")
    if batches and (not isinstance(context, int) or context < 2):
        raise ValueError(f"context: must be >= 2, got {context!r}")
    if predict:
        bad = [p for p in precisions if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions: unknown {bad[0]!r}; expected one of {', '.join(PRECISIONS)}")
        for name, values in (("predict_batches", predict_batches), ("predict_contexts", predict_contexts or [2])):
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}: must be positive integers, got {values!r}")
    if llm is None:
        # The ceilings first: their copy and matmul buffers (a few GiB on a GPU) must fit before the
        # engine takes its weights and KV pool.
        ceilings = load_ceilings(resolve_device(EngineConfig(device=device).device), remeasure=remeasure)
        llm = build_llm(model, batches, context, prefill_len, prefill_batch,
                        **dict(engine_kwargs or {}, device=device, dtype=dtype))
    else:
        ceilings = load_ceilings(llm.engine.cfg.device, remeasure=remeasure)
    engine = llm.engine
    cfg, ecfg = engine.model_cfg, engine.cfg
    fmt = format_of(ecfg.dtype)
    model = engine.runner.model
    steps = []
    plans = [("prefill", prefill_batch, prefill_len)] if prefill_len else []
    plans += [("decode", b, context) for b in batches]
    filled = False
    for kind, batch, length in plans:
        if kind == "prefill":
            built = build_prefill(engine, batch, length, sampling)
        else:
            if not filled:
                fill_kv_pool(engine.runner)
                filled = True
            built = build_decode(engine, batch, length, sampling)
        try:
            timing = time_engine_step(engine, built, reps=reps, warmup=warmup)
        finally:
            release(engine, built)
        steps.append(diagnose_step(kind, built.shape, step_costs(model, built.shape), timing, ceilings,
                                   built.batch, built.context, built.query_len))
    predictions, budget = None, None
    if predict:
        contexts = [c for c in (predict_contexts or DEFAULT_CONTEXTS) if c <= cfg.max_position_embeddings]
        contexts = contexts or [cfg.max_position_embeddings]
        predictions = predict_grid(cfg, ceilings, predict_batches, contexts, precisions, kv_budget,
                                   ecfg.page_size, greedy=sampling == "greedy")
        budget = kv_budget if kv_budget is not None else default_kv_budget(cfg, ceilings, fmt)
    info = dict(architecture=cfg.architecture, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                parameters=model_weights(engine.runner.model),
                parameter_bytes=parameter_bytes(model))
    notes = []
    if ecfg.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 and ecfg.dtype == torch.float32:
        notes.append("float32 GEMMs run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)")
    rep = Report(model=ecfg.model, model_name=os.path.basename(os.path.normpath(ecfg.model)), model_info=info,
                 device=ceilings.name, device_type=ceilings.device, dtype=str(ecfg.dtype).removeprefix("torch."),
                 backend=engine.runner.backend.name, compute_roof=ceilings.roof(fmt.compute),
                 ceilings=ceilings, steps=steps, predictions=predictions,
                 kv_budget_bytes=budget, created=datetime.datetime.now().isoformat(timespec="seconds"),
                 command=command, notes=notes)
    if out:
        write_report(rep, out)
    return rep


def predict_tensor_parallel(model: str | None, tensor_parallel_size: int, *, device: str = "auto",
                            dtype: str = "auto", batches=DEFAULT_BATCHES, contexts=None,
                            precisions=DEFAULT_PRECISIONS, kv_budget: float | None = None, page_size: int | None = None,
                            remeasure: bool = False, out: str | None = None, sampling: str = "greedy",
                            command: str | None = None) -> Report:
    """The prediction grid for N ranks (no steps measured): each rank's share of the model on its
    own GPU (KV budget a rank), the collectives at the link's roof among N ranks (measured once
    and cached where this machine has N GPUs, or N CPU processes; else the assumed NVLink figures,
    said in the notes)."""
    n = tensor_parallel_size
    cfg = ModelConfig.from_dir(model_dir(model))
    share = RankShare(cfg, n)                   # validates N and the architecture
    dev = resolve_device(EngineConfig(device=device or "auto").device)
    torch_dtype = resolve_dtype(dtype or "auto", cfg, dev)
    ceilings = load_ceilings(dev, remeasure=remeasure, ranks=n)
    link = ceilings.link(n)
    notes = [f"tensor_parallel_size {n}: prediction only (measured steps time one process: run ridge roofline "
             f"at tensor_parallel_size 1 for those); each row is a step of {n} ranks, each with its share, "
             f"collectives in line (not overlapped)", link.describe()]
    if not link.measured:
        notes.append(f"the link among {n} ranks was not measured ({dev.type}: "
                     f"{torch.cuda.device_count() if dev.type == 'cuda' else 0} GPUs here): its collectives' "
                     f"times use the assumed figures")
    contexts = [c for c in (contexts or DEFAULT_CONTEXTS) if c <= cfg.max_position_embeddings] \
        or [cfg.max_position_embeddings]
    predictions = predict_grid(cfg, ceilings, batches, contexts, precisions, kv_budget, page_size or 16,
                               greedy=sampling == "greedy", tensor_parallel_size=n)
    fmt = format_of(torch_dtype)
    budget = kv_budget if kv_budget is not None else default_kv_budget(share, ceilings, fmt)
    whole = meta_model(cfg, torch_dtype)
    info = dict(architecture=cfg.architecture, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                parameters=model_weights(whole), parameter_bytes=parameter_bytes(cfg, _one(torch_dtype)),
                tensor_parallel_size=n, rank_parameter_bytes=parameter_bytes(share, _one(torch_dtype)))
    path = model_dir(model)
    rep = Report(model=path, model_name=os.path.basename(os.path.normpath(path)), model_info=info,
                 device=ceilings.name, device_type=ceilings.device, dtype=str(torch_dtype).removeprefix("torch."),
                 backend="none (prediction only)", compute_roof=ceilings.roof(fmt.compute), ceilings=ceilings,
                 steps=[], predictions=predictions, kv_budget_bytes=budget,
                 created=datetime.datetime.now().isoformat(timespec="seconds"), command=command, notes=notes)
    if out:
        write_report(rep, out)
    return rep


def _one(dtype: torch.dtype):
    from ridge.layers.cost import StepShape
    return StepShape((1,), (1,), dtype=dtype)
