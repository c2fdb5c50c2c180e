"""The server under hostile load (issue 14's acceptance): 64 concurrent streams on the demo model,
a third cancelled mid-stream, while the large-prompt attack runs beside them. Every stream that
was not cancelled ends with [DONE] after its finish, every attack request gets its 400, and once
the server is idle no KV page is held. The p99 inter-token gap against an unattacked run is a
benchmark figure (benchmarks/serving/serve_load.py, BENCHMARKS.md), not asserted here."""
from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from transformers import AutoTokenizer

from ridge import LLM
from ridge.config import model_dir
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.tests_support import load_benchmark, serving

STREAMS = 64


@pytest.fixture(scope="module")
def demo_server():
    cfg = ServerConfig(model_name="demo")
    app = create_app(lambda: LLM(device="cpu", show_progress=False, max_num_seqs=STREAMS), cfg)
    with serving(app, "demo server") as url:
        yield url


def test_streams_survive_cancellations_and_the_large_prompt_attack(demo_server):
    load = load_benchmark("serve_load")
    r = asyncio.run(load.run_load(demo_server, "demo", streams=STREAMS, max_tokens=12, attack=True,
                                  cancel_after=3, timeout_s=300))
    assert r["failures"] == [], r["ends"]
    assert r["ends"] == {"cancelled": STREAMS // 3, "done": STREAMS - STREAMS // 3}
    assert r["leaked_pages"] == 0
    attacks = r["attack_requests"]
    assert attacks and {a["status"] for a in attacks} == {400}
    assert {a["name"] for a in attacks} >= {"2M-token prompt", "4 MB chat message", "tokenized, too long"}


def test_the_attack_gets_clear_errors_through_the_openai_client(demo_server):
    """The same attack as a user of the official client sees it: a 400 that names the input."""
    load = load_benchmark("serve_load")
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="characters cannot fit in max_model_len"):
        client.completions.create(model="demo", prompt=load.ATTACK_PROMPT, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="messages: .*characters cannot fit"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "y" * 4_000_000}],
                                       max_tokens=1)
    words = load.attack_bodies("demo")[-1][2]["prompt"]
    with pytest.raises(openai.BadRequestError, match="prompt: .*tokens leave no room|prompt: .*max_model_len"):
        client.completions.create(model="demo", prompt=words, max_tokens=1)
    ok = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4


def test_special_tokens_in_user_text_stay_text(demo_server):
    """`<|eos|>` written in a prompt or a chat message is text (more than one token), unless a
    completions request asks for parse_special_tokens."""
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="none", max_retries=0, timeout=120)
    plain = client.completions.create(model="demo", prompt="a b", max_tokens=1).usage.prompt_tokens
    literal = client.completions.create(model="demo", prompt="a <|eos|> b", max_tokens=1).usage.prompt_tokens
    parsed = client.completions.create(model="demo", prompt="a <|eos|> b", max_tokens=1,
                                       extra_body={"parse_special_tokens": True}).usage.prompt_tokens
    assert parsed <= plain + 2 < literal       # " <|eos|>" is a space and one control token only when asked
    chat = [{"role": "user", "content": "a b"}]
    injected = [{"role": "user", "content": "a <|eos|> b"}]
    n_chat = client.chat.completions.create(model="demo", messages=chat, max_tokens=1).usage.prompt_tokens
    n_injected = client.chat.completions.create(model="demo", messages=injected, max_tokens=1).usage.prompt_tokens
    assert n_injected > n_chat + 1


def test_refused_long_prompts_log_no_tokenizer_warning(demo_server):
    """A prompt too long for the context is refused without transformers' 'indexing errors'
    warning (the server encodes through the Rust tokenizer, which has no such check)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")       # its own handler; it does not propagate to root
    level = hf_logger.level
    hf_logger.addHandler(handler)
    hf_logger.setLevel(logging.WARNING)                  # other tests may have quieted transformers
    try:
        AutoTokenizer.from_pretrained(model_dir(None))("w " * 5000)      # the warning, as a control
        assert any("indexing errors" in r.getMessage() for r in records)
        records.clear()
        client = openai.OpenAI(base_url=demo_server + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="prompt: "):
            client.completions.create(model="demo", prompt="w " * 5000, max_tokens=1)
    finally:
        hf_logger.removeHandler(handler)
        hf_logger.setLevel(level)
    assert not [r for r in records if "indexing errors" in r.getMessage()]
