"""The reasoning parsers (--reasoning-parser) on outputs in DeepSeek R1's and Qwen3's formats: complete,
cut inside the reasoning (no end tag), without tags, with whitespace before the start tag; and their
streaming side: fed char by char, cut at every boundary and in random pieces, the streamed reasoning and
content add up to the whole output's, and nothing sent is ever taken back (no part of a tag goes out)."""
from __future__ import annotations

import random

import pytest

from ridge.cli import build_parser
from ridge.server.config import ServerConfig
from ridge.server.reasoning_parsers import REASONING_PARSERS, DeepSeekR1Parser, Qwen3Parser

# DeepSeek R1 (its template opens <think> in the prompt: the output starts inside the reasoning)
R1 = ("Okay, the user asks for 2 + 2. That is basic arithmetic: 2 + 2 = 4.\n</think>\n\n"
      "**Answer:** 2 + 2 = 4.")
# DeepSeek R1-0528 and the distills under older templates write the start tag themselves
R1_0528 = "<think>\nLet me check: 17 is prime, it has no divisor between 2 and 4.\n</think>\n\nYes, 17 is prime."
# Qwen3 (thinking on): the model opens and closes the block
QWEN3 = ("<think>\nOkay, the user said hello in Chinese: 你好. I should greet back 😊.\n</think>\n\n"
         "你好！有什么可以帮你的吗？")
# Qwen3 with enable_thinking false: the template wrote an empty block in the prompt, the output is the answer
QWEN3_NO_THINKING = "Hello! How can I help you today?"
CUT = "<think>\nThe user wants a long proof. First, assume the contrary: let p be the largest prime, and"

DEEPSEEK_CASES = [
    (R1, "Okay, the user asks for 2 + 2. That is basic arithmetic: 2 + 2 = 4.\n", "\n\n**Answer:** 2 + 2 = 4."),
    (R1_0528, "\nLet me check: 17 is prime, it has no divisor between 2 and 4.\n", "\n\nYes, 17 is prime."),
    (QWEN3, "\nOkay, the user said hello in Chinese: 你好. I should greet back 😊.\n", "\n\n你好！有什么可以帮你的吗？"),
    (CUT, CUT[len("<think>"):], None),                      # cut by max_tokens: all of it is reasoning
    ("no tags at all", "no tags at all", None),              # never closed: reasoning
    ("\n\n<think>a</think>b", "a", "b"),                     # whitespace before the start tag goes with it
    ("</think>\n\nJust the answer.", None, "\n\nJust the answer."),    # an empty reasoning is null
    ("thinking</think>", "thinking", None),                  # stopped right after the end tag: no content
    ("a</think>b</think>c", "a", "b</think>c"),              # the first end tag ends it
    ("a <think> b</think>c", "a <think> b", "c"),            # a start tag inside the reasoning is text
    ("<thi", "<thi", None),                                  # the start of a tag, then the end: text
    ("", None, None),
]
QWEN3_CASES = [
    (QWEN3, "\nOkay, the user said hello in Chinese: 你好. I should greet back 😊.\n", "\n\n你好！有什么可以帮你的吗？"),
    (R1_0528, "\nLet me check: 17 is prime, it has no divisor between 2 and 4.\n", "\n\nYes, 17 is prime."),
    (QWEN3_NO_THINKING, None, QWEN3_NO_THINKING),            # no start tag: all content
    (R1, None, R1),                                          # an end tag without the start tag: content too
    (CUT, CUT[len("<think>"):], None),                       # opened and cut short: reasoning
    (" \n<think>\nx\n</think>y", "\nx\n", "y"),
    ("<think></think>\n\nHi", None, "\n\nHi"),              # an empty block (a template's thinking-off mark)
    ("Sure. <think>x</think>", None, "Sure. <think>x</think>"),     # a tag after text is text
    ("<thinking>x</thinking>", None, "<thinking>x</thinking>"),
    ("<think", None, "<think"),
    ("\n\n", None, "\n\n"),
    ("", None, ""),                                          # no reasoning: the content as it is, as without a parser
]


@pytest.mark.parametrize("text, reasoning, content", DEEPSEEK_CASES)
def test_deepseek_r1(text, reasoning, content):
    assert DeepSeekR1Parser().parse(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", QWEN3_CASES)
def test_qwen3(text, reasoning, content):
    assert Qwen3Parser().parse(text) == (reasoning, content)


def test_explicit_only_under_a_grammar():
    """implicit=False (a structured output wrote the output): deepseek_r1 too needs the start tag."""
    assert DeepSeekR1Parser().parse('{"a": 1}', implicit=False) == (None, '{"a": 1}')
    assert DeepSeekR1Parser().parse("<think>x</think>{}", implicit=False) == ("x", "{}")
    assert Qwen3Parser().parse("<think>x</think>{}", implicit=False) == ("x", "{}")


def test_registry_and_setting(capsys):
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert all(REASONING_PARSERS[name]().name == name for name in REASONING_PARSERS)
    assert build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    # an unknown name: the flag (or the setting) and the choices named
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'deepseek_r1', 'qwen3'" in err, err
    with pytest.raises(ValueError, match=r"^reasoning_parser: must be one of deepseek_r1, qwen3; got 'granite'"):
        ServerConfig(model_name="m", reasoning_parser="granite")


# -- streaming --------------------------------------------------------------------------------------------
ALL = [(name, text) for name, cases in (("deepseek_r1", DEEPSEEK_CASES), ("qwen3", QWEN3_CASES))
       for text, _, _ in cases]


def _streamed(name: str, pieces: list[str], implicit: bool = True) -> tuple[str, str]:
    """The reasoning and content a stream of `pieces` sends, checking as it goes that what has gone out
    is a start of the whole answer's (nothing sent is taken back, so no part of a tag is sent)."""
    parser = REASONING_PARSERS[name]()
    whole_r, whole_c = (x or "" for x in parser.parse("".join(pieces), implicit))
    split = parser.split(implicit)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = split.step(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        assert whole_r.startswith(reasoning) and whole_c.startswith(content), (pieces[:i + 1], reasoning, content)
        assert not content or reasoning == whole_r              # the content begins after the whole reasoning
    return reasoning, content


def _expected(name: str, text: str, implicit: bool = True) -> tuple[str, str]:
    r, c = REASONING_PARSERS[name]().parse(text, implicit)
    return r or "", c or ""


@pytest.mark.parametrize("name, text", ALL)
def test_streamed_char_by_char_equals_whole(name, text):
    assert _streamed(name, list(text) or [""]) == _expected(name, text)


@pytest.mark.parametrize("name, text", ALL)
def test_streamed_cut_at_every_boundary_equals_whole(name, text):
    for i in range(len(text) + 1):
        assert _streamed(name, [text[:i], text[i:]]) == _expected(name, text), i
        # and with an empty piece (a token whose text is held back) in the middle
        assert _streamed(name, [text[:i], "", text[i:]]) == _expected(name, text), i


@pytest.mark.parametrize("name, text", ALL)
def test_streamed_in_random_pieces_equals_whole(name, text):
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _streamed(name, pieces) == _expected(name, text), pieces
        assert _streamed(name, pieces, implicit=False) == _expected(name, text, implicit=False), pieces


def test_stream_holds_back_what_may_become_a_tag():
    split = DeepSeekR1Parser().split()
    assert split.step("\n ") == ("", "")                 # may open with <think>
    assert split.step("<th") == ("", "")
    assert split.step("ink>Hm, ") == ("Hm, ", "")        # it did: dropped
    assert split.step("a </") == ("a ", "")              # "</" may become </think>
    assert split.step("b> c <") == ("</b> c ", "")       # it did not
    assert split.step("/think") == ("", "")
    assert split.step(">\n\nDone") == ("", "\n\nDone")
    split = Qwen3Parser().split()
    assert split.step("\n") == ("", "")
    assert split.step("Hi") == ("", "\nHi")              # not a start tag: content from the first character
    assert split.step("</think>") == ("", "</think>")
