"""`ridge` command line: generate, eval-ppl, and the parsers of serve, bench, roofline and quantize.

Every command that builds an engine takes its flags from `ridge.config.EngineConfig` through
`ridge.settings.add_arguments`, and turns them back into a validated config with
`settings.from_args`, so a setting is declared once and every command has it."""
from __future__ import annotations

import argparse
import sys

from ridge import settings
from ridge.config import EngineConfig


def cmd_generate(a: argparse.Namespace) -> int:
    from ridge import LLM, SamplingParams
    from ridge.server.text_stream import TextDelta

    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                            max_tokens=a.max_tokens, seed=a.sample_seed, stop=a.stop or None,
                            repetition_penalty=a.repetition_penalty)
    llm = LLM(show_progress=False, **settings.from_args(EngineConfig, a).as_kwargs())
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


# the settings that make a run lower-precision than its checkpoint: reset for eval-ppl's reference
FULL_PRECISION = dict(quantization=None, kv_cache_dtype="auto", kv_cache_hadamard=False)


def cmd_eval_ppl(a: argparse.Namespace) -> int:
    import json

    from ridge import LLM
    from ridge.config import model_dir
    from ridge.eval_ppl import check_files, compare, heldout_files, perplexity

    cfg = settings.from_args(EngineConfig, a)
    if a.compare and cfg.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size: --compare reads the model's hidden states in this process; run it "
                         f"with 1 (got {cfg.tensor_parallel_size})")
    # the inputs are checked before the model loads: a typo costs a moment, not a load
    files = a.files or heldout_files(model_dir(cfg.model))
    check_files(files)
    llm = LLM(show_progress=False, **cfg.as_kwargs())
    if a.compare:
        # the reference runs under the same engine settings but in full precision: its weights are
        # the compared checkpoint's, read as they are stored, and its KV cache is in the model dtype
        reference = LLM(show_progress=False, **{**cfg.as_kwargs(), "model": a.compare, **FULL_PRECISION})
        r = compare(llm, reference, files, seq_len=a.seq_len)
    else:
        r = perplexity(llm, files, seq_len=a.seq_len)
    summary = dict(model=llm.engine.cfg.model, dtype=str(llm.engine.cfg.dtype).removeprefix("torch."),
                   device=str(llm.engine.cfg.device), seq_len=a.seq_len, **vars(r))
    if a.compare:
        summary["reference"] = reference.engine.cfg.model
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"perplexity {r.perplexity:.3f}  (nll {r.nll_per_token:.4f} nats/token, {r.tokens} tokens, "
          f"{r.files} files, {r.windows} windows of {a.seq_len})")
    if a.compare:
        print(f"reference {a.compare}: perplexity {r.reference_perplexity:.3f}; KL(reference || model) "
              f"{r.kl_divergence:.5f} nats/token, top-1 agreement {r.top1_agreement:.4f}")
    return 0


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors shown alone: argparse prints the whole usage block (every
    engine flag) before the one line that says what was wrong. Subcommands' parsers are this class
    too (add_subparsers makes its parsers of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="ridge", description="ridge: an LLM inference engine in Python and Triton")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, streaming the text to stdout")
    g.add_argument("prompt")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    s.add_argument("--top-k", type=int, default=-1, help="-1: off (default: -1)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the top one's probability (default: 0.0)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off; in [0.01, 100] (default: 1.0)")
    s.add_argument("--sample-seed", type=int, default=None,
                   help="seed of this request's sampling (default: drawn from --seed)")
    s.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    s.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    settings.add_arguments(g, EngineConfig, title="engine")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval-ppl", help="perplexity on text files (default: the model's held-out stdlib files)")
    e.add_argument("--files", nargs="+", default=None, help="text files (default: the model's held-out files)")
    e.add_argument("--seq-len", type=int, default=512, help="tokens per scored window (default: 512)")
    e.add_argument("--json", default=None, help="write the result as JSON here")
    e.add_argument("--compare", default=None, metavar="MODEL",
                   help="also score the same windows with MODEL (e.g. the unquantized checkpoint) and report the "
                        "KL divergence of the next-token distributions against it (default: off)")
    settings.add_arguments(e, EngineConfig, title="engine")
    e.set_defaults(func=cmd_eval_ppl)

    from ridge.roofline.cli import add_roofline_parser
    add_roofline_parser(sub)

    from ridge.server.cli import add_serve_parser
    add_serve_parser(sub)

    from ridge.quantize.command import add_quantize_parser
    add_quantize_parser(sub)

    from ridge.utils.trace_explain import add_trace_parser
    add_trace_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, soak")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ridge.bench.latency import add_latency_parser
    from ridge.bench.throughput import add_throughput_parser
    add_latency_parser(bench_sub)
    add_throughput_parser(bench_sub)
    from ridge.bench.serve import add_serve_bench_parser
    add_serve_bench_parser(bench_sub)
    from ridge.bench.soak import add_soak_bench_parser
    add_soak_bench_parser(bench_sub)
    return ap


def serve_rank_0(a: argparse.Namespace) -> bool:
    """Under torchrun (--distributed-executor-backend external_launcher), a rank > 0 runs no command
    (no server to bind, no prompt to print): it serves rank 0's engine until it closes. True when
    this process did that."""
    if getattr(a, "distributed_executor_backend", None) != "external_launcher" or a.tensor_parallel_size == 1:
        return False
    from ridge.parallel import launched
    if launched().rank == 0:
        return False
    from ridge import LLM
    try:
        LLM(show_progress=False, **settings.from_args(EngineConfig, a).as_kwargs())
    except SystemExit:          # what a rank > 0's LLM(...) ends with once rank 0 has closed
        pass
    return True


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if serve_rank_0(a):
            return 0
        if getattr(a, "ray", False):    # Ray is imported only here, when asked for
            from ridge.ray_serve.app import cmd_serve_ray
            return cmd_serve_ray(a)
        return a.func(a)
    except ValueError as e:
        print(f"ridge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:          # Ctrl-C: a line, not a traceback (the shell's code for SIGINT)
        print("ridge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
