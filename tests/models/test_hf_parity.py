"""Acceptance: greedy tokens identical to transformers' generate, first-step logits to 1e-4."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from ridge import LLM, SamplingParams
from ridge.eval_ppl import token_logprobs
from tests.tests_support import PROMPT_LENGTHS, prompt_of


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def assert_first_step_logits_match(engine, hf, prompts, name: str) -> None:
    """The logits the engine's first step samples from, for the whole batch at once, against
    transformers' last-position logits of each prompt; the requests are aborted after."""
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule()).logits
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        rel = ((logits[row] - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, f"{name}: prompt {row} logits rel err {rel:.2e}"
    for rid in list(engine.requests):
        engine.abort(rid)


@pytest.mark.parametrize("name", ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3", "llama-mqa", "mistral-sw",
                                  "mixtral", "qwen2moe", "qwen2moe-step2", "qwen3moe", "qwen3moe-dense0",
                                  "deepseekv2", "deepseekv2-grouped", "deepseekv3", "deepseekv3-yarn"])
def test_greedy_and_logits_match_transformers(checkpoints, name):
    path = checkpoints(name)
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [prompt_of(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]

    engine = llm.engine
    assert_first_step_logits_match(engine, hf, prompts, name)
    assert engine.pages.num_free_pages == engine.cfg.num_pages

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32), name
        assert o.outputs[0].finish_reason == "length"
    assert engine.pages.num_free_pages == engine.cfg.num_pages


def test_text_prompt_and_chat_template(checkpoints):
    path = checkpoints("llama")
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=256)
    out = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer("def fib(n):")["input_ids"]
    assert len(out.outputs[0].token_ids) == 8
    # streaming detokenization holds back an unfinished UTF-8 sequence instead of emitting U+FFFD
    full = llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.outputs[0].text == full.rstrip("\ufffd")
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                                 tokenize=False)
    assert chat.prompt_token_ids == llm.tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_directory_without_tokenizer_takes_token_ids(tmp_path):
    from ridge.utils.random_checkpoint import make_random_checkpoint
    path = make_random_checkpoint(str(tmp_path / "notok"), with_tokenizer=False)
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=128)
    out = llm.generate([prompt_of(5)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_bad_checkpoints_fail_clearly(tmp_path, checkpoints):
    import json
    import shutil
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "unknown"
    shutil.copytree(checkpoints("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad), device="cpu", show_progress=False)

    missing = tmp_path / "missing"
    shutil.copytree(checkpoints("llama"), missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(str(missing), device="cpu", show_progress=False)


def test_prompt_logprobs_match_transformers_under_chunking_and_caching(checkpoints):
    path = checkpoints("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # a 64-token budget cuts the 150-token prompts into chunks; the second prompt shares the
    # first one's pages in the prefix cache, which scoring requests must not skip
    llm = LLM(path, device="cpu", show_progress=False, max_model_len=256, max_num_batched_tokens=64)
    first = prompt_of(150, salt=1)
    prompts = [first, first[:100] + prompt_of(50, salt=2)]
    llm.generate([first], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]
        expected = ref.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)
        assert o.prompt_logprobs[0] is None
        assert torch.allclose(torch.tensor(token_logprobs(o)), expected, atol=1e-4)
        # each position also names its top 2 candidates, and the prompt token's rank among all
        top_v, top_i = ref.topk(2, dim=-1)
        for pos, entry in enumerate(o.prompt_logprobs[1:]):
            chosen = entry[p[pos + 1]]
            assert chosen.rank == int((ref[pos] > ref[pos, p[pos + 1]]).sum()) + 1
            for r in range(2):
                tok = int(top_i[pos, r])
                assert tok in entry and abs(entry[tok].logprob - float(top_v[pos, r])) < 1e-4
                assert entry[tok].rank == r + 1
