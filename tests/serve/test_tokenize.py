"""The byte-level tokenizer of generation (moejax.serve.tokenize)."""

from __future__ import annotations

import types

import pytest

from moejax.config import ConfigError
from moejax.serve.tokenize import get_tokenizer


def test_bytes_round_trip_with_document_separator():
  tok = get_tokenizer()
  assert tok.encode("hé") == [0, 104, 195, 169]
  assert tok.encode("hé", add_bos=False) == [104, 195, 169]
  assert tok.decode([104, 195, 169]) == "hé"
  assert tok.decode([104, 195]) == "h\ufffd"  # a cut multi-byte character never fails
  assert tok.stop_id == 0 and tok.vocab_size == 256


def test_unknown_tokenizer_and_small_vocab_are_errors():
  with pytest.raises(ConfigError, match="data.tokenizer='bpe'"):
    get_tokenizer(types.SimpleNamespace(tokenizer="bpe"))
  with pytest.raises(ConfigError, match="model.vocab_size=32"):
    get_tokenizer(None, vocab_size=32)
