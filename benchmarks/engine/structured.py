"""Structured outputs' cost (issue 45): XGrammar's compile time for a schema of --fields fields, cold
(a fresh compiler) and cached (the engine's cache, a second request with the same schema), and the
decode-time overhead of a JSON-schema constraint: output tokens/s of the same greedy requests with
and without the constraint at each batch size, and the mask's host time a step (filling the rows'
bitmasks, queueing their copy and the apply; the device's part is not waited for), from the engine's
Grammars.mask in a round of its own, which also times the fill alone one matcher after another and
with XGrammar's threaded BatchGrammarMatcher on the same states. Medians of --repeats rounds.

The constrained and free runs decode the same number of tokens: free requests run with
ignore_eos to the constrained run's lengths, so the ratio is per output token.

    python benchmarks/engine/structured.py --batches 1 16 --json structured.json
    python benchmarks/engine/structured.py --model CONFIG_8B --load-format dummy --batches 1 64 --json s.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from ridge import LLM, SamplingParams  # noqa: E402
from ridge.bench.common import device_name, format_table, write_json  # noqa: E402


def wide_schema(fields: int) -> dict:
    """An object of `fields` required fields cycling through string (bounded), integer, enum,
    boolean and number arrays: what an agent's form-filling tool takes."""
    kinds = [{"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 10**6},
             {"enum": ["low", "medium", "high"]}, {"type": "boolean"},
             {"type": "array", "items": {"type": "number"}, "maxItems": 3}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_times(llm, schema: dict) -> dict:
    from ridge.engine.structured import Grammars, StructuredOutputsParams
    intake, cfg = llm.engine.intake, llm.engine.model_cfg
    params = StructuredOutputsParams(json=schema)
    t0 = time.perf_counter()
    Grammars(intake.tokenizer, cfg.vocab_size, list(cfg.eos_token_ids)).compile(params)
    cold = time.perf_counter() - t0
    intake.compile_grammar(SamplingParams(structured_outputs=params))       # the engine's own, warmed
    t0 = time.perf_counter()
    intake.compile_grammar(SamplingParams(structured_outputs=params))
    return dict(compile_cold_ms=1e3 * cold, compile_cached_ms=1e3 * (time.perf_counter() - t0))


def decode_overhead(llm, schema: dict, batch: int, max_tokens: int, repeats: int) -> dict:
    """Medians over `repeats` rounds, each timing the constrained requests, then the free ones of the
    same lengths (alternating, so a drift of the machine's speed falls on both)."""
    engine = llm.engine
    prompts = [f"# record {i}\nrecord = " for i in range(batch)]
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs={"json": schema})
    outs = llm.generate(prompts, constrained, use_tqdm=False)               # warm-up: compile, kernels
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts, free, use_tqdm=False)
    grammars = engine.intake.grammars
    mask, spent, fills = grammars.mask, [], []
    batch_fill = grammars.xgr.BatchGrammarMatcher()

    def timed_mask(logits, seqs):
        """The mask's host time (fill, copy and apply queued; the device's part is not waited for),
        and the fill alone both ways on the same states: one matcher after another (what the engine
        does) and XGrammar's threaded batch fill, each into a scratch buffer."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.is_finished]
        scratch = torch.empty((len(seqs), (grammars.vocab_size + 31) // 32), dtype=torch.int32)
        t0 = time.perf_counter()
        for i in rows:
            seqs[i].grammar.fill_next_token_bitmask(scratch, i)
        t1 = time.perf_counter()
        batch_fill.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], scratch, rows)
        t2 = time.perf_counter()
        mask(logits, seqs)
        spent.append(time.perf_counter() - t2)
        fills.append((t1 - t0, t2 - t1))

    def timed(params) -> tuple[float, list]:
        sync()
        t0 = time.perf_counter()
        got = llm.generate(prompts, params, use_tqdm=False)
        sync()
        return time.perf_counter() - t0, got

    rounds = []
    for _ in range(repeats):
        c_s, outs = timed(constrained)
        f_s, _ = timed(free)
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths        # greedy: the same outputs
        rounds.append((c_s, f_s))
    grammars.mask = timed_mask          # one more constrained round, for the mask's own time (the
    timed(constrained)                  # extra fills stay out of the timed rounds)
    grammars.mask = mask
    c_s, f_s = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    tokens = sum(lengths)
    return dict(batch=batch, tokens=tokens, repeats=repeats,
                all_complete=all(o.outputs[0].finish_reason == "stop" for o in outs),
                constrained_tok_s=tokens / c_s, free_tok_s=tokens / f_s, overhead_per_token=c_s / f_s - 1,
                ratios=[c / f for c, f in rounds], mask_host_ms_per_step=1e3 * statistics.median(spent),
                mask_host_share=sum(spent) / c_s,
                fill_serial_ms_per_step=1e3 * statistics.median(f[0] for f in fills),
                fill_batch_ms_per_step=1e3 * statistics.median(f[1] for f in fills))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--fields", type=int, default=50)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load-format", default="auto", help="dummy: random weights for a config-only checkpoint "
                                                          "(the 8B shape); the grammar holds the output to the schema")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    llm = LLM(a.model, show_progress=False, max_model_len=2048, load_format=a.load_format)
    schema = wide_schema(a.fields)
    result = dict(benchmark="structured", device=device_name(llm.engine.cfg.device), fields=a.fields,
                  **compile_times(llm, schema), rows=[decode_overhead(llm, schema, b, a.max_tokens, a.repeats) for b in a.batches])
    print(f"compile, {a.fields}-field schema: cold {result['compile_cold_ms']:.1f} ms, "
          f"cached {result['compile_cached_ms']:.3f} ms")
    print(format_table(["batch", "tokens", "free tok/s", "constrained tok/s", "overhead", "mask host ms/step",
                        "share", "fill serial ms", "fill threaded ms"],
                       [[r["batch"], r["tokens"], f"{r['free_tok_s']:.1f}", f"{r['constrained_tok_s']:.1f}",
                         f"{r['overhead_per_token']:+.1%}", f"{r['mask_host_ms_per_step']:.3f}",
                         f"{r['mask_host_share']:.1%}", f"{r['fill_serial_ms_per_step']:.3f}",
                         f"{r['fill_batch_ms_per_step']:.3f}"]
                        for r in result["rows"]], title=f"JSON-schema constraint, {result['device']}"))
    if a.json:
        write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
