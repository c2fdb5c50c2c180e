"""`ridge` command line: generate, eval-ppl."""
from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV pool size: bytes if > 1, else a fraction of free memory")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16,
                   help="tokens per KV-cache page (--block-size: vLLM's name)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each decode step's tokens back before preparing the next step "
                        "(default: prepare and launch it while the GPU still runs the previous one)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    kv = a.kv_cache_memory
    if kv is not None and kv > 1:
        kv = int(kv)
    return dict(model=a.model, device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                kv_cache_memory=kv, page_size=a.page_size, enable_prefix_caching=not a.no_prefix_caching,
                seed=a.seed, enforce_eager=a.enforce_eager, async_scheduling=not a.no_async_scheduling)


def cmd_generate(a: argparse.Namespace) -> int:
    from ridge import LLM, SamplingParams
    from ridge.server.text_stream import TextDelta

    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                            max_tokens=a.max_tokens, seed=a.sample_seed, stop=a.stop or None,
                            repetition_penalty=a.repetition_penalty)
    llm = LLM(show_progress=False, **engine_kwargs(a))
    engine = llm.engine
    engine.add_request(a.prompt, params)
    # Hold back as many characters as a stop string could still need, so none leaks out.
    shown = TextDelta(params.stop_strings)
    if a.echo:
        sys.stdout.write(a.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(shown.delta(out.outputs[0].text, out.finished))
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_eval_ppl(a: argparse.Namespace) -> int:
    import json

    from ridge import LLM
    from ridge.eval_ppl import heldout_files, perplexity

    llm = LLM(show_progress=False, **engine_kwargs(a))
    files = a.files or heldout_files(llm.engine.cfg.model)
    r = perplexity(llm, files, seq_len=a.seq_len)
    summary = dict(model=llm.engine.cfg.model, dtype=str(llm.engine.cfg.dtype).removeprefix("torch."),
                   device=str(llm.engine.cfg.device), seq_len=a.seq_len, **vars(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"perplexity {r.perplexity:.3f}  (nll {r.nll_per_token:.4f} nats/token, {r.tokens} tokens, "
          f"{r.files} files, {r.windows} windows of {a.seq_len})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ridge", description="ridge: an LLM inference engine in Python and Triton")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, streaming the text to stdout")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval-ppl", help="perplexity on text files (default: the model's held-out stdlib files)")
    add_engine_args(e)
    e.add_argument("--files", nargs="+", default=None)
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--json", default=None, help="write the result as JSON here")
    e.set_defaults(func=cmd_eval_ppl)

    from ridge.roofline.cli import add_roofline_parser
    add_roofline_parser(sub)

    from ridge.server.cli import add_serve_parser
    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ridge.bench.latency import add_latency_parser
    from ridge.bench.throughput import add_throughput_parser
    add_latency_parser(bench_sub)
    add_throughput_parser(bench_sub)
    from ridge.bench.serve import add_serve_bench_parser
    add_serve_bench_parser(bench_sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except ValueError as e:
        print(f"ridge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
