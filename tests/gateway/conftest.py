"""Fixtures of the gateway's tests: its tokenizer, and the reference it is checked against."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from gateway.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The gateway's own tokenizer (`ChatTokenizer`) on the session's checkpoint directory."""
    tokenizer = ChatTokenizer.from_dir(model_dir)
    yield tokenizer
    tokenizer.close()


@pytest.fixture(scope="module")
def reference_tokenizer(model_dir) -> Tokenizer:
    """The `tokenizers` library on the same file: the independent reference for token ids."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
