"""Logprob tokens are the text they contribute (issue 14, item 2): byte-level BPE "Ġ=" reads
" =", "Ċ" reads "\\n", a part of a UTF-8 character is OpenAI's "bytes:\\xe2" with its true bytes,
chat `bytes` are those bytes, and legacy completions fill `text_offset`. Checked on the
library, on the formatting, and through the official openai client against a server running
the bundled demo model (a real byte-level BPE vocabulary, which writes "€" as three one-byte
tokens)."""
from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.request import Logprob
from ridge.engine.token_text import TokenTexts
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from ridge.server.logprobs import TextOffsets, chat_logprobs
from tests.server_support import KEY, Served
from tests.tests_support import serving

MODEL = "demo"
CODE = "def fib(n):\n    if n < 2:\n        return n\n"     # the demo model continues it with newlines
EUROS = "s = '€€€€€€€€"                                      # ... and this with more euro signs, byte by byte
EURO_BYTES = [b"\xe2", b"\x82", b"\xac"]


def raw_of(name: str) -> bytes:
    """The bytes an OpenAI "bytes:" name spells."""
    return re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes([int(m.group(1), 16)]), name[len("bytes:"):].encode())


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=256)


# -- naming, without a model ---------------------------------------------------------------------
def test_byte_level_tokens_are_named_by_their_text(demo_tokenizer):
    texts = TokenTexts(demo_tokenizer)
    ids = demo_tokenizer(" = 1\n\n€", add_special_tokens=False)["input_ids"]
    assert demo_tokenizer.convert_ids_to_tokens(ids) == ["Ġ=", "Ġ1", "Ċ", "Ċ", "â", "Ĥ", "¬"]   # the example
    assert [texts(i) for i in ids] == [(" =", b" ="), (" 1", b" 1"), ("\n", b"\n"), ("\n", b"\n"),
                                       ("bytes:\\xe2", b"\xe2"), ("bytes:\\x82", b"\x82"), ("bytes:\\xac", b"\xac")]
    assert texts(demo_tokenizer.convert_tokens_to_ids("ĊĊ")) == ("\n\n", b"\n\n")
    assert texts(demo_tokenizer.eos_token_id) == ("<|eos|>", None)      # special: named, but no text bytes
    assert texts(len(demo_tokenizer)) == (None, None)                   # an id past the tokenizer's vocabulary


def test_sentencepiece_byte_fallback_tokens():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "t", "h", "e", "▁t", "▁th", "▁the"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("▁t", "h"), ("▁th", "e")], byte_fallback=True,
                               unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])     # Llama's: strips the text's first space
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    texts = TokenTexts(hf)
    ids = hf("the\n€", add_special_tokens=False)["input_ids"]
    assert hf.convert_ids_to_tokens(ids) == ["▁the", "<0x0A>", "<0xE2>", "<0x82>", "<0xAC>"]
    assert [texts(i) for i in ids] == [(" the", b" the"), ("\n", b"\n"), ("bytes:\\xe2", b"\xe2"),
                                       ("bytes:\\x82", b"\x82"), ("bytes:\\xac", b"\xac")]


def test_text_offsets_follow_openai():
    """OpenAI's own answer for "，适合": "，" at 0, both parts of 适 (e9 80 | 82) at 1, 合 at 2; a
    special token adds nothing to a text that skips it."""
    lps = [Logprob(0.0, 1, "，", "，".encode()), Logprob(0.0, 1, "bytes:\\xe9\\x80", b"\xe9\x80"),
           Logprob(0.0, 1, "bytes:\\x82", b"\x82"), Logprob(0.0, 1, "<|eos|>", None), Logprob(0.0, 1, "合", "合".encode()),
           Logprob(0.0, 1, "!", b"!")]
    offsets = TextOffsets()
    assert [offsets.advance(lp) for lp in lps] == [0, 1, 1, 2, 2, 3]
    offsets = TextOffsets(skip_special_tokens=False)
    assert [offsets.advance(lp) for lp in lps] == [0, 1, 1, 2, 9, 10]


def test_chat_bytes_of_special_and_unknown_tokens():
    entries = [{1: Logprob(-0.5, 1, "<|eos|>", None), 7: Logprob(-1.0, 2, None, None)}]
    content = chat_logprobs([1], entries, 2).content[0]
    assert (content.token, content.bytes) == ("<|eos|>", list(b"<|eos|>"))
    assert [(t.token, t.bytes) for t in content.top_logprobs] == [("<|eos|>", list(b"<|eos|>")), ("token_id:7", None)]


# -- the library -----------------------------------------------------------------------------------
def test_library_decoded_tokens_join_into_the_text(demo_llm):
    out = demo_llm.generate(CODE, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0].outputs[0]
    chosen = [e[t] for t, e in zip(out.token_ids, out.logprobs)]
    assert "\n" in out.text and "".join(lp.decoded_token for lp in chosen) == out.text
    assert any(lp.decoded_token == "\n" and lp.token_bytes == b"\n" for lp in chosen)
    for entry in out.logprobs:                 # every candidate, not only the sampled one
        for lp in entry.values():
            assert lp.token_bytes is None or lp.decoded_token == lp.token_bytes.decode()
            assert not re.search("[ĠĊ]", lp.decoded_token)


def test_library_partial_characters_carry_their_bytes(demo_llm):
    out = demo_llm.generate(EUROS, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    chosen = [e[t] for t, e in zip(out.token_ids, out.logprobs)]
    assert out.text == "€€"
    assert [lp.token_bytes for lp in chosen] == EURO_BYTES * 2
    assert [lp.decoded_token for lp in chosen] == ["bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"] * 2


# -- the server, through the openai client -------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_server():
    cfg = ServerConfig(model_name=MODEL, api_key=KEY)
    app = create_app(lambda: LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=256,
                                 kv_cache_memory=16 << 20), cfg)
    with serving(app) as url:
        yield Served(url, app)


def test_completion_tokens_are_text_with_offsets(demo_server):
    c = demo_server.client()
    choice = c.completions.create(model=MODEL, prompt=CODE, max_tokens=8, temperature=0, logprobs=2).choices[0]
    lp = choice.logprobs
    assert "\n" in lp.tokens and "".join(lp.tokens) == choice.text
    starts = [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset == starts and starts[0] == 0
    assert all(choice.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    assert all(not re.search("[ĠĊ]", name) for top in lp.top_logprobs for name in top)
    # a stream: one token a chunk, the offsets running on across chunks
    chunks = [ch.choices[0] for ch in c.completions.create(model=MODEL, prompt=CODE, max_tokens=8, temperature=0,
                                                           logprobs=2, stream=True) if ch.choices]
    streamed = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset]
    assert streamed == lp.text_offset and sum(len(ch.logprobs.tokens) > 0 for ch in chunks if ch.logprobs) == 8


def test_completion_partial_characters(demo_server):
    c = demo_server.client()
    choice = c.completions.create(model=MODEL, prompt=EUROS, max_tokens=6, temperature=0, logprobs=1).choices[0]
    assert choice.text == "€€"
    assert choice.logprobs.tokens == ["bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"] * 2
    assert choice.logprobs.text_offset == [0, 0, 0, 1, 1, 1]      # each part where its character starts


def test_chat_bytes_are_the_tokens_bytes(demo_server):
    # after many euro signs the demo model answers "\n", and a first byte of a character is among
    # its 20 best candidates
    r = demo_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "€" * 68}],
                                                     max_tokens=2, temperature=0, logprobs=True, top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert (content[0].token, content[0].bytes) == ("\n", [10])
    candidates = [t for c in content for t in [c, *c.top_logprobs]]
    partial = [t for t in candidates if t.token.startswith("bytes:")]
    assert partial, "no candidate is part of a character"
    for t in partial:
        assert bytes(t.bytes) == raw_of(t.token) and t.bytes != [239, 191, 189]
        with pytest.raises(UnicodeDecodeError):
            bytes(t.bytes).decode()
    assert all(bytes(t.bytes).decode() == t.token for t in candidates if not t.token.startswith("bytes:"))
