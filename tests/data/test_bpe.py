"""Subword tokens: determinism, round trip, per-token labels, caching, vocab check, batches."""

import os

import numpy as np
import pytest

from moejax import data
from moejax.config import ConfigError
from moejax.data import bpe, Documents
from moejax.data.labels import CODE, COMMENT, STRING, PYTHON_DOMAINS, label_python_source

V = 300  # separator + 256 bytes + 43 merges: enough for the corpora below

SOURCES = [
    'def add(a, b):\n  """Add two numbers."""\n  return a + b  # the sum\n',
    'x = "héllo wörld"  # a string, ünïcode\nprint(x, x, x)\n',
    'class Point:\n  """A point."""\n  def __init__(self, x, y):\n    self.x, self.y = x, y\n',
    'for i in range(10):\n  if i % 2:\n    print("odd", i)  # odd\n  else:\n    print("even")\n',
]


def corpus(repeat: int = 8) -> Documents:
  """The sources above (with their real labels), each ``repeat`` times."""
  pairs = [label_python_source(s) for s in SOURCES] * repeat
  return Documents.from_arrays([d for d, _ in pairs], [l for _, l in pairs],
                               domain_names=PYTHON_DOMAINS, name="handmade")


@pytest.fixture(scope="module")
def tok():
  return bpe.BpeTokenizer(bpe.train(corpus(), V), V)


def test_training_is_deterministic(tmp_path):
  a = bpe.load_or_train(str(tmp_path / "a"), corpus(), V)
  b = bpe.load_or_train(str(tmp_path / "b"), corpus(), V)
  with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
    assert fa.read() == fb.read()
  assert bpe.train(corpus(), V) == a.json
  assert a.hf.get_vocab_size() == V  # the corpus filled the vocabulary: there are merges
  # Another vocab size is another file in another cache directory.
  c = bpe.load_or_train(str(tmp_path / "a"), corpus(), V + 10)
  assert os.path.dirname(c.path) != os.path.dirname(a.path) and c.json != a.json


def test_ids_separator_bytes_and_token_bytes(tok):
  assert tok.hf.id_to_token(data.SEPARATOR_ID) == bpe.SEPARATOR_TOKEN
  # Ids 1..256 are the bytes; every later id is a merge of >= 2 bytes.
  assert sorted(tok.pieces[1:257]) == [bytes([b]) for b in range(256)]
  assert all(len(p) >= 2 for p in tok.pieces[257:])
  np.testing.assert_array_equal(tok.token_bytes, [len(p) for p in tok.pieces])
  assert tok.token_bytes[data.SEPARATOR_ID] == 1  # counts as byte 0 does at byte level
  # Our byte <-> character table is the one tokenizers' ByteLevel uses.
  from tokenizers import pre_tokenizers
  assert set(bpe.CHAR_TO_BYTE) == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", [
    "", "x", "def f():\n\treturn 1  \n", "naïve café 日本語 🙂\n", "a<|sep|>b", "nul\0byte",
    SOURCES[1] * 3])
def test_round_trip(tok, text):
  raw = text.encode("utf-8")
  ids, labels = tok.encode(raw)
  assert ids.dtype == np.uint16 and labels.shape == ids.shape
  assert tok.decode(ids) == raw
  assert tok.hf.decode(ids.tolist()) == text
  if raw:
    assert data.SEPARATOR_ID not in ids  # a literal '<|sep|>' or NUL is text, not a separator


def test_a_token_never_straddles_a_domain_boundary():
  # 'abab' where the label changes in the middle, 50 times: without the
  # pre-split on domain spans 'abab' (or 'ba') would be the first merges.
  docs = Documents.from_arrays([b"abab"] * 50, [[0, 0, 1, 1]] * 50, domain_names=("x", "y"))
  tok = bpe.BpeTokenizer(bpe.train(docs, 260), 260)
  assert b"ab" in tok.pieces and not any(b"ba" in p for p in tok.pieces)
  ab = tok.pieces.index(b"ab")
  ids, labels = tok.encode(b"abab", np.array([0, 0, 1, 1]))
  np.testing.assert_array_equal(ids, [ab, ab])
  np.testing.assert_array_equal(labels, [0, 1])


def test_labels_per_token_on_a_handmade_document(tok):
  src = 'y = "ab"  # ab\n'
  raw, byte_labels = label_python_source(src)
  # code 'y = ', string '"ab"', code '  ', comment '# ab', code '\n'.
  assert [(s, e, l) for s, e, l in bpe.domain_spans(raw, byte_labels)] == [
      (0, 4, CODE), (4, 8, STRING), (8, 10, CODE), (10, 14, COMMENT), (14, 15, CODE)]
  ids, labels = tok.encode(raw, byte_labels)
  expected = []
  for s, e, label in bpe.domain_spans(raw, byte_labels):
    expected += [label] * len(tok.encode_spans([raw[s:e].decode()])[0])
  np.testing.assert_array_equal(labels, expected)
  # The rule, checked byte by byte: every byte of a token has the token's label.
  pos = 0
  for i, label in zip(ids, labels):
    n = len(tok.pieces[i])
    assert set(byte_labels[pos:pos + n].tolist()) == {label}
    pos += n
  assert pos == len(raw)


def test_boundary_inside_a_utf8_character_moves_to_its_end():
  raw = "aéb".encode("utf-8")  # a, 0xC3 0xA9, b
  assert bpe.domain_spans(raw, np.array([0, 0, 1, 1])) == [(0, 3, 0), (3, 4, 1)]
  assert bpe.domain_spans(raw, np.array([0, 1, 1, 1])) == [(0, 1, 0), (1, 4, 1)]
  assert bpe.domain_spans(b"", np.zeros(0)) == []


def test_encode_documents_keeps_names_domains_and_bytes(tok):
  docs = corpus(repeat=1)
  enc = bpe.encode_documents(docs, tok)
  assert len(enc) == len(docs) and enc.domain_names == docs.domain_names
  assert enc.vocab_size == V and enc.metadata["tokenizer"]["sha256"] == tok.sha256
  for d, e in zip(docs, enc):
    assert e.name == d.name and tok.decode(e.tokens) == d.tokens.tobytes()
    # A document's tokens cover exactly its bytes.
    assert enc.bytes_per_token()[e.tokens].sum() == len(d.tokens)
  assert enc.num_tokens() < docs.num_tokens()  # it compresses


def test_second_load_does_not_retrain_or_reencode(tmp_path, monkeypatch):
  d = str(tmp_path)
  tok = bpe.load_or_train(d, corpus(), V)
  first = bpe.encoded_split(d, corpus(), tok)
  stamps = {f: os.stat(os.path.join(os.path.dirname(tok.path), f)).st_mtime_ns
            for f in os.listdir(os.path.dirname(tok.path))}

  def boom(*args, **kwargs):
    raise AssertionError("retrained or re-encoded")

  monkeypatch.setattr(bpe, "train", boom)
  monkeypatch.setattr(bpe, "_encode_all", boom)
  again = bpe.load_or_train(d, corpus(), V)
  second = bpe.encoded_split(d, corpus(), again)
  assert again.json == tok.json
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.labels, b.labels)
  assert {f: os.stat(os.path.join(os.path.dirname(tok.path), f)).st_mtime_ns
          for f in stamps} == stamps
  # Another corpus is another cache entry: it trains (and here, boom).
  with pytest.raises(AssertionError, match="retrained"):
    bpe.load_or_train(d, corpus(repeat=9), V)


def test_vocab_size_follows_the_tokenizer():
  assert data.vocab_size(data.DataConfig()) == data.VOCAB_SIZE == 256
  bpe_cfg = data.DataConfig(tokenizer="bpe", bpe_vocab_size=4096)
  assert data.vocab_size(bpe_cfg) == 4096
  data.check_vocab_size(4096, bpe_cfg)
  with pytest.raises(ConfigError) as e:
    data.check_vocab_size(256, bpe_cfg)
  assert e.value.field == "model.vocab_size" and e.value.value == 256
  assert ("set model.vocab_size=4096 for data.tokenizer='bpe' with bpe_vocab_size=4096"
          in str(e.value))
  with pytest.raises(ConfigError, match=r"set model.vocab_size=256 for data.tokenizer='bytes'"):
    data.check_vocab_size(4096, data.DataConfig())


@pytest.mark.parametrize("field, value, match", [
    ("tokenizer", "bpf", "did you mean 'bpe'"),
    ("bpe_vocab_size", 256, r"\[257, 65536\]"),
    ("bpe_vocab_size", 70000, r"\[257, 65536\]"),
])
def test_data_config_rejects_bad_tokenizer_fields(field, value, match):
  with pytest.raises(ConfigError, match=match) as e:
    data.DataConfig(**{field: value})
  assert e.value.field == f"data.{field}"


def test_batches_carry_target_bytes():
  # Byte level: one byte per real target, so loss per byte == loss per token.
  docs = Documents.from_arrays([b"ab", b"cde", b"f"])
  for train in (False, True):
    for batch in data.make_batch_iterator(docs, seq_len=3, batch_size=2, train=train):
      np.testing.assert_array_equal(batch["target_bytes"], batch["mask"].astype(np.int32))
      if train:
        break
  # Subword: the table's byte lengths, 0 on padding.
  table = np.array([1, 1, 1, 2, 5], np.int32)
  doc = data.Document(np.array([3, 4, 2], np.uint16), np.zeros(3, np.uint8))
  sub = Documents(name="t", split="validation", domain_names=("x",), length=1,
                  get=lambda i: doc, vocab_size=5, token_bytes=table)
  (batch,) = data.make_batch_iterator(sub, seq_len=2, batch_size=2, train=False)
  # Stream 0 3 4 2: rows [0 3 4] and [4 2 (pad)].
  np.testing.assert_array_equal(batch["targets"], [[3, 4], [2, 0]])
  np.testing.assert_array_equal(batch["target_bytes"], [[2, 5], [1, 0]])


def test_unigram_baseline_counts_subword_ids(tok):
  enc = bpe.encode_documents(corpus(repeat=1), tok)
  counts = data.token_counts(enc)
  assert counts.shape == (V,) and counts.sum() == enc.num_tokens() + len(enc)
  assert 0 < data.unigram_cross_entropy(enc, enc) < np.log(V)


def test_python_stdlib_bpe_end_to_end(tmp_path):
  cfg = data.DataConfig(tokenizer="bpe", bpe_vocab_size=V, data_dir=str(tmp_path),
                        stdlib_max_files=4, stdlib_val_fraction=0.3, seq_len=16, batch_size=2)
  raw = data.get_dataset("python_stdlib", "validation", str(tmp_path),
                         config=cfg.builder_config())
  docs = data.load_documents(cfg, "validation")
  assert docs.domain_names == PYTHON_DOMAINS and len(docs) == len(raw) > 0
  tok = data.load_tokenizer(cfg)
  assert tok.path.startswith(os.path.join(str(tmp_path), bpe.CACHE_DIR, "python_stdlib"))
  assert data.tokenizer_identity(cfg) == docs.metadata["tokenizer"]
  assert data.tokenizer_identity(data.DataConfig()) == {"tokenizer": "bytes"}
  for r, d in zip(raw, docs):
    assert tok.decode(d.tokens) == r.tokens.tobytes()
  # The validation pass scores every byte of the stream but the first separator.
  total = sum(b["target_bytes"].sum() for b in data.make_batches(cfg, "validation"))
  assert total == raw.num_tokens() + len(raw) - 1


def test_synthetic_and_tfds_text_datasets(tmp_path):
  cfg = data.DataConfig(name="synthetic_domains", tokenizer="bpe", bpe_vocab_size=V,
                        data_dir=str(tmp_path), synthetic_train_docs=8, synthetic_val_docs=4,
                        synthetic_min_doc_bytes=64, synthetic_max_doc_bytes=128)
  raw = data.get_dataset("synthetic_domains", "validation", str(tmp_path),
                         config=cfg.builder_config())
  for r, d in zip(raw, data.load_documents(cfg, "validation")):
    assert data.load_tokenizer(cfg).decode(d.tokens) == r.tokens.tobytes()
    assert set(d.labels.tolist()) == set(r.labels.tolist())  # one domain per document
  from tests.data.test_datasets import SPLITS, prepare_shakespeare
  prepare_shakespeare(str(tmp_path), "array_record")
  cfg = data.DataConfig(name="tiny_shakespeare", tokenizer="bpe", bpe_vocab_size=V,
                        data_dir=str(tmp_path))
  tok = data.load_tokenizer(cfg)
  assert tok.hf.get_vocab_size() < V  # a 21-byte train split leaves ids unused
  (doc,) = data.load_documents(cfg, "validation")
  assert tok.decode(doc.tokens) == SPLITS["validation"].encode("utf-8")


def test_tiny_bpe_run_trains_end_to_end(tmp_path):
  """configs/tiny.py on BPE tokens: it learns, and eval reports per token and per byte."""
  import io
  import json
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import loop, metrics_log
  from tests.train import helpers
  cfg = helpers.experiment("tiny", str(tmp_path / "tfds"), data__tokenizer="bpe",
                           data__bpe_vocab_size=512, model__vocab_size=512, train__steps=60,
                           train__checkpoint_every=0, train__eval_every=0)
  workdir = str(tmp_path / "run")
  summary = loop.train(cfg, workdir, out=io.StringIO())
  train = {r["step"]: r for r in metrics_log.read_metrics(workdir, "train")}
  assert train[60]["loss"] < train[5]["loss"] - 1.0, (train[5]["loss"], train[60]["loss"])
  assert summary["val_loss"] < summary["unigram_baseline"], summary
  (final,) = metrics_log.read_metrics(workdir, "eval")
  # Several bytes per token: per byte is below per token, by the compression ratio.
  ratio = final["bytes"] / final["tokens"]
  assert ratio > 2.0
  np.testing.assert_allclose(final["loss_per_byte"], final["loss"] / ratio, rtol=1e-5)
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE)) as f:
    saved = json.load(f)["data"]
  assert (saved["tokenizer"], saved["bpe_vocab_size"]) == ("bpe", 512)


def test_default_bpe_config_is_the_default_on_bpe_tokens():
  from tests.train import helpers
  default, sub = helpers.experiment("default"), helpers.experiment("default_bpe")
  assert (sub.data.tokenizer, sub.data.bpe_vocab_size, sub.model.vocab_size) == ("bpe", 4096, 4096)
  from moejax.config import apply_overrides
  assert apply_overrides(sub, {"data.tokenizer": "bytes", "model.vocab_size": 256}) == default
