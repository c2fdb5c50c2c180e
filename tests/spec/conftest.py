"""Fixtures of the speculative-decoding tests (tests/spec/spec_support.py holds the rest)."""
import pytest

from tests.spec.spec_support import DEMO, llm


@pytest.fixture(scope="module")
def pair(checkpoints):
    """(target, draft) random checkpoints with one vocabulary and different weights."""
    return checkpoints("llama"), checkpoints("qwen2")


@pytest.fixture(scope="module")
def demo_plain():
    return llm(DEMO)
