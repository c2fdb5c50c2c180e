"""Prompt encoding (ridge.engine.prompts): special-token strings in user text stay text, chat
markup keeps its control tokens, over-long text is refused by its length alone, and what the
encoder produces matches transformers where there is nothing to escape."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ridge import SamplingParams
from ridge.engine.prompts import PromptEncoder, _max_chars

EOS = "<|eos|>"


@pytest.fixture(scope="module")
def enc(tiny_llm):
    return tiny_llm.encoder


def test_special_token_text_in_a_prompt_is_literal_unless_asked(enc, tiny_llm):
    eos_id = tiny_llm.tokenizer.convert_tokens_to_ids(EOS)
    text = f"one {EOS} two"
    literal, parsed = enc.encode(text), enc.encode(text, parse_special_tokens=True)
    assert eos_id not in literal and eos_id in parsed
    assert tiny_llm.tokenizer.decode(literal, skip_special_tokens=True).endswith(text)    # it is all still there
    assert parsed == tiny_llm.tokenizer(text)["input_ids"]                               # today's (HF) behaviour
    plain = "one two three"
    assert enc.encode(plain) == enc.encode(plain, parse_special_tokens=True) == tiny_llm.tokenizer(plain)["input_ids"]


def test_generate_takes_the_option_and_checks_it(tiny_llm):
    text = f"a {EOS} b"
    sp = SamplingParams(max_tokens=1, temperature=0)
    default = tiny_llm.generate(text, sp, use_tqdm=False)[0]
    parsed = tiny_llm.generate(text, sp, use_tqdm=False, parse_special_tokens=True)[0]
    assert default.prompt_token_ids == tiny_llm.encoder.encode(text)
    assert parsed.prompt_token_ids == tiny_llm.tokenizer(text)["input_ids"]
    assert parsed.prompt == text
    with pytest.raises(ValueError, match="parse_special_tokens"):
        tiny_llm.generate(text, sp, parse_special_tokens="yes")


def test_chat_content_never_becomes_a_control_token(enc, tiny_llm):
    tok = tiny_llm.tokenizer
    eos_id = tok.convert_tokens_to_ids(EOS)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"x{EOS}y"},
            {"role": "user", "content": f"{EOS}"}]
    ids = enc.chat(msgs)
    render = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    hf = tok(render, add_special_tokens=False)["input_ids"]
    # the template ends each of the 3 messages with EOS: exactly those 3 are control tokens
    assert ids.count(eos_id) == 3 and hf.count(eos_id) == 5
    assert tok.decode(ids) == render                    # same text, only the injected ones are literal
    clean = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"}]
    clean_render = tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    assert enc.chat(clean) == tok(clean_render, add_special_tokens=False)["input_ids"]   # HF-exact


def test_chat_whose_template_rewrites_content_refuses_special_tokens(tiny_llm):
    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_llm.tokenizer.backend_tokenizer, eos_token=EOS,
                                  bos_token="<|bos|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{{ eos_token }}{% endfor %}"
    enc = PromptEncoder(tok, 512)
    assert enc.chat([{"role": "user", "content": "abc"}])      # nothing to escape: encoded as rendered
    with pytest.raises(ValueError, match="special token '<\\|eos\\|>'"):
        enc.chat([{"role": "user", "content": f"abc{EOS}"}])


def test_over_long_text_is_refused_by_its_length(enc, tiny_llm):
    assert enc.max_chars is not None
    longest = max(len(s) for s in tiny_llm.tokenizer.backend_tokenizer.get_vocab())
    assert enc.max_chars == 512 * longest
    # the bound is sound: text just under it is encoded, text over it is refused unread
    assert len(enc.encode("ab " * 1000)) > 0
    with pytest.raises(ValueError, match=r"^prompt: \d+ characters cannot fit in max_model_len=512"):
        enc.encode("x" * (enc.max_chars + 1))
    with pytest.raises(ValueError, match=r"^messages: \d+ characters cannot fit"):
        enc.chat([{"role": "user", "content": "y" * (enc.max_chars + 1)}])
    with pytest.raises(ValueError, match="prompt: .*characters cannot fit"):
        tiny_llm.generate("z " * enc.max_chars, SamplingParams(max_tokens=1), use_tqdm=False)


def test_no_length_bound_where_the_tokenizer_drops_characters():
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()       # "a      b" is 2 tokens
    assert _max_chars(wordpiece, 8) is None
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    assert _max_chars(bpe, 8) == 16
    bpe.normalizer = normalizers.Strip()                        # strips: shorter than the text
    assert _max_chars(bpe, 8) is None
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "_")])
    assert _max_chars(bpe, 8) == 16
