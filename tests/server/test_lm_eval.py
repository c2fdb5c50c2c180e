"""lm-evaluation-harness end to end against `ridge serve` on the bundled demo model, as a user
runs it (README, "Evaluating with lm-evaluation-harness"): its `local-completions` model, two
tasks this test writes itself over local JSONL files (no download, the hub offline), one
generate-until and one multiple-choice. Both finish and report a score, and every
loglikelihood lm-eval computes from the served echo+logprobs answers equals the one `ridge
eval-ppl` scores for the same tokens (eval_ppl.score, the same model in this process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ridge import LLM
from ridge.assets import DEMO_MODEL, demo_model_path
from ridge.eval_ppl import score
from tests.server_support import ServeProcess

KEY = "sk-lm-eval"
GENERATE = [{"prompt": "def add(a, b):\n    return", "answer": " a + b"},
            {"prompt": "import os\nimport", "answer": " sys"},
            {"prompt": "for i in range(", "answer": "10):"}]
CHOOSE = [{"question": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"], "label": 0},
          {"question": "import os\nimport", "choices": ["sys", "banana", "42"], "label": 0},
          {"question": "for i in range(10):\n   ", "choices": ["print(i)", "return", "class"], "label": 0}]


def _write_tasks(root) -> None:
    for name, rows in (("gen", GENERATE), ("mc", CHOOSE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root}/{{name}}.jsonl
        test_split: test
    """
    (root / "ridge_gen.yaml").write_text(textwrap.dedent("""
        task: ridge_gen""" + common.format(name="gen") + """
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 8
          do_sample: false
          temperature: 0
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
    """))
    (root / "ridge_mc.yaml").write_text(textwrap.dedent("""
        task: ridge_mc""" + common.format(name="mc") + """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{label}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
    """))


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a causal model's request (TemplateLM._encode_pair, no BOS): trailing
    spaces of the context go to the continuation, and the continuation's tokens are those the
    whole text has after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


@pytest.mark.slow
def test_lm_eval_harness_against_ridge_serve(tmp_path):
    _write_tasks(tmp_path)
    server = ServeProcess(["--api-key", KEY], tmp_path / "serve.log")
    try:
        server.wait_ready()
        env = dict(os.environ, OPENAI_API_KEY=KEY, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
        model_args = (f"model={DEMO_MODEL},base_url={server.url}/v1/completions,tokenizer={demo_model_path()},"
                      "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        run = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                              "--model_args", model_args, "--tasks", "ridge_gen", "ridge_mc",
                              "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"),
                              "--log_samples"], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        server.stop()
    out = tmp_path / "out" / DEMO_MODEL
    results = json.loads(next(out.glob("results_*.json")).read_text())["results"]
    for task, metric in (("ridge_gen", "exact_match,none"), ("ridge_mc", "acc,none")):
        assert 0 <= results[task][metric] <= 1, results
    generated = [json.loads(line) for line in next(out.glob("samples_ridge_gen_*.jsonl")).open()]
    assert len(generated) == len(GENERATE) and all(isinstance(s["filtered_resps"][0], str) for s in generated)

    # every loglikelihood is eval-ppl's: the sum of the continuation's token logprobs given the context
    llm = LLM(show_progress=False, device="cpu")
    served, windows, spans = [], [], []
    for sample in (json.loads(line) for line in next(out.glob("samples_ridge_mc_*.jsonl")).open()):
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            ctx, cont = _encode_pair(llm.tokenizer, args["arg_0"], args["arg_1"])
            served.append(float(resp[0][0]))
            windows.append(ctx + cont)
            spans.append(len(ctx))
    assert len(served) == sum(len(c["choices"]) for c in CHOOSE)
    expected = [sum(lps[start - 1:]) for lps, start in zip(score(llm, windows), spans)]
    assert served == pytest.approx(expected, abs=1e-5)
