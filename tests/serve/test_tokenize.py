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
  with pytest.raises(ConfigError, match="data.tokenizer='sentencepiece'"):
    get_tokenizer(types.SimpleNamespace(tokenizer="sentencepiece"))
  with pytest.raises(ConfigError, match="model.vocab_size=32"):
    get_tokenizer(None, vocab_size=32)


def test_bpe_prompts_round_trip_through_the_runs_tokenizer(tmp_path):
  """A BPE run's prompts use its own trained vocabulary (id 0 opens the document)."""
  from moejax.data import DataConfig
  cfg = DataConfig(name="synthetic_domains", data_dir=str(tmp_path), tokenizer="bpe",
                   bpe_vocab_size=300, synthetic_train_docs=40, synthetic_val_docs=8)
  tok = get_tokenizer(cfg, vocab_size=300)
  ids = tok.encode("def f(x):\n  return x")
  assert ids[0] == 0 and max(ids) < 300
  assert tok.decode(ids[1:]) == "def f(x):\n  return x"
