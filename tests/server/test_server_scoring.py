"""Scoring text through /v1/completions as lm-evaluation-harness and vLLM's clients do (echo with
logprobs, max_tokens 0, prompt_logprobs), the served /openapi.json, whole-number floats as
integers and the 415 for a body that is not JSON. The tiny checkpoint on loopback, checked
against the engine's own prompt log-probabilities."""
from __future__ import annotations

import json

import re

import httpx
import pytest

from ridge import SamplingParams
from tests.server_support import AUTH, MODEL

C = "/v1/completions"
IDS = [5, 17, 300, 42, 9, 111]


def _engine_prompt_entries(llm, prompt, k: int):
    return llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k),
                        use_tqdm=False)[0].prompt_logprobs


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text[:500]
    return r.json()


def test_echo_with_logprobs_puts_the_scored_prompt_first(server, tiny_llm):
    """lm-eval's loglikelihood request: the prompt's tokens (the first without a logprob) with
    the engine's values, then the one generated token; text is the prompt's then the completion's."""
    body = {"model": MODEL, "prompt": [IDS], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    choice = _ok(server.post(C, body))["choices"][0]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(IDS) + 1
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    entries = _engine_prompt_entries(tiny_llm, IDS, 1)
    for pos in range(1, len(IDS)):
        assert lps["token_logprobs"][pos] == pytest.approx(entries[pos][IDS[pos]].logprob, abs=1e-5)
        assert len(lps["top_logprobs"][pos]) in (1, 2)       # the token and the top 1 (the same or not)
        assert max(lps["top_logprobs"][pos].values()) >= lps["token_logprobs"][pos]
    # offsets index the choice's text: every token's text starts where its offset says (the tiny
    # tokenizer lacks some ids of the model's vocabulary: those are named token_id:N and spell nothing)
    for tok, at in zip(lps["tokens"], lps["text_offset"]):
        if not tok.startswith(("bytes:", "token_id:")):
            assert choice["text"][at:at + len(tok)] == tok
    expected = tiny_llm.generate([IDS], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert choice["text"].endswith(expected.outputs[0].text)


def test_echo_of_a_text_prompt_keeps_its_text(server):
    prompt = "def add(a, b):\n    return"
    for max_tokens in (0, 3):
        r = _ok(server.post(C, {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "temperature": 0}))
        assert r["choices"][0]["text"].startswith(prompt)
        if max_tokens == 0:
            assert r["choices"][0]["text"] == prompt and r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_scores_the_prompt_only(server, tiny_llm):
    """vLLM's form: max_tokens 0 with echo returns the prompt's tokens and their logprobs alone."""
    r = _ok(server.post(C, {"prompt": [IDS, IDS[:3]], "max_tokens": 0, "logprobs": 2, "echo": True}))
    entries = _engine_prompt_entries(tiny_llm, IDS, 2)
    first = next(ch for ch in r["choices"] if ch["index"] == 0)
    assert len(first["logprobs"]["tokens"]) == len(IDS) and first["finish_reason"] == "length"
    got = first["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx([e[t].logprob for t, e in zip(IDS[1:], entries[1:])], abs=1e-5)
    assert all(len(top) >= 2 for top in first["logprobs"]["top_logprobs"][1:])
    assert r["usage"] == {"prompt_tokens": len(IDS) + 3, "completion_tokens": 0, "total_tokens": len(IDS) + 3}


def test_prompt_logprobs_field(server, tiny_llm):
    """vLLM's prompt_logprobs: by position, token id -> logprob, rank and name; None first."""
    r = _ok(server.post(C, {"prompt": IDS, "max_tokens": 2, "prompt_logprobs": 3, "temperature": 0}))
    plp = r["choices"][0]["prompt_logprobs"]
    entries = _engine_prompt_entries(tiny_llm, IDS, 3)
    assert plp[0] is None and len(plp) == len(IDS)
    for pos in range(1, len(IDS)):
        assert str(IDS[pos]) in plp[pos] and 3 <= len(plp[pos]) <= 4
        for tok, v in plp[pos].items():
            assert v["logprob"] == pytest.approx(entries[pos][int(tok)].logprob, abs=1e-5)
            assert v["rank"] == entries[pos][int(tok)].rank
            assert v["decoded_token"] == entries[pos][int(tok)].decoded_token
    assert r["choices"][0]["logprobs"] is None and len(r["choices"][0]["text"]) >= 0


def test_echo_streamed_matches_the_whole_answer(server):
    body = {"prompt": IDS, "max_tokens": 4, "logprobs": 1, "echo": True, "temperature": 0, "ignore_eos": True}
    whole = _ok(server.post(C, body))["choices"][0]
    text, tokens, offsets = "", [], []
    with httpx.stream("POST", server.url + C, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                if ch["logprobs"] is not None:
                    tokens += ch["logprobs"]["tokens"]
                    offsets += ch["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def test_whole_number_floats_are_integers(server):
    r = _ok(server.post(C, {"prompt": [5.0, 6.0, 7], "max_tokens": 2.0, "n": 1.0, "temperature": 0,
                            "ignore_eos": True}))
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    for bad in (2.5, "2", True, 1e300):
        err = server.post(C, {"prompt": "x", "max_tokens": bad}).json()["error"]
        assert err["param"] == "max_tokens", (bad, err)


def test_a_body_that_is_not_json_gets_415(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    r = server.post(C, content=body, headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    for media in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        headers = {**AUTH, **({"Content-Type": media} if media else {})}
        assert server.post(C, content=body, headers=headers).status_code == 200, media


def test_docs_page_is_served_offline(server):
    """/docs loads Swagger UI from the server itself: no address elsewhere (a CDN, the schema
    validator), and every script, style sheet and icon the page names is served."""
    page = httpx.get(server.url + "/docs", timeout=30)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert not re.search(r"https?:|//", page.text), page.text          # no absolute or scheme-relative URL
    assert '"validatorUrl": null' in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(assets) == 3 and all(a.startswith("/docs/") for a in assets), assets
    for asset in assets + ["/openapi.json"]:
        r = httpx.get(server.url + asset, timeout=30)
        assert r.status_code == 200 and len(r.content) > 1000, asset


def test_openapi_states_the_served_limits(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 4                              # the engine's max_n
    token_lists = [a for a in completion["prompt"]["anyOf"] if a.get("items", {}).get("type") == "integer"]
    assert token_lists[0]["items"]["maximum"] == 511                    # below the vocabulary
    assert token_lists[0]["maxItems"] == 255                            # max_model_len - 1
    ops = doc["paths"]["/v1/completions"]["post"]
    assert ops["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                                    "CompletionRequest"}
    assert set(ops["responses"]["400"]["x-schema-valid-refusals"]) == {"context_length_exceeded",
                                                                        "conflicting_parameters",
                                                                        "invalid_structured_output"}
    for name in ("CompletionRequest", "ChatCompletionRequest"):     # the structured-output fields documented
        assert {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar"} <= set(schemas[name]["properties"])
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": [5] * 255, "max_tokens": 16}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "def f(): pass\n" * 200}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "conflicting_parameters"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "conflicting_parameters"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "conflicting_parameters"),
])
def test_refusals_of_schema_valid_requests_carry_the_listed_codes(server, body, param, code):
    err = server.post(C, body).json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
