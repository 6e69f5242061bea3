"""Subword tokens: a byte-level BPE vocabulary trained on a dataset's train split.

Legend: L bytes of one document, n its BPE tokens, N documents, V the
vocabulary size (``DataConfig.bpe_vocab_size``).

Why: at byte level, hash routing of a token is a fixed expert per byte and
"specialisation by token" is specialisation by character. Subword tokens
make both mean what they mean in the literature.

The tokenizer is GPT-2's byte-level BPE (Radford et al. 2019, "Language
Models are Unsupervised Multitask Learners", section 2.2) as Hugging Face
``tokenizers`` implements it: the ``ByteLevel`` pre-tokenizer (GPT-2's
regex splits; every byte is a base symbol, so any text encodes, with no
unknown token) and ``BpeTrainer(vocab_size=V, min_frequency=2)``. Ids:

- 0: the document separator ``<|sep|>`` (``documents.SEPARATOR_ID``, which
  the packer inserts); never produced from text (special-token matching is
  off, so a literal ``<|sep|>`` in a document encodes as its bytes);
- 1 .. 256: the 256 bytes; then the merges, in the order learnt. A corpus
  too small to fill V leaves the top ids unused (the model still has V).

Domain labels stay per token. Each document is cut into domain spans
(maximal runs of one label) before BPE, both for training and for
encoding, so no token straddles a domain boundary: a token's label is the
label of every one of its bytes. (Rule for the one exception: a boundary
inside a UTF-8 character, which none of the built-in labellers produce,
moves to the end of that character, and the token's label is its first
byte's.)

Bytes per token (``token_bytes``, int32[V]): the UTF-8 bytes an id stands
for; the separator counts 1, as byte 0 does in the byte-level stream. So a
split covers the same number of bytes under both tokenizers, and the
validation loss per byte (``moejax/evaluate/validation.py``) compares runs
of either kind.

Cache, under ``data_dir`` next to the TFDS data::

    <data_dir>/moejax_tokenizers/<dataset>/bpe<V>-<key>/
        tokenizer.json    trained once, on the train split only
        meta.json         settings, corpus identity, library version, sha256
        <split>.npz       an encoded split: ids, labels, offsets, names

``key`` hashes the settings and the train split's identity (dataset name,
split, document count and the dataset's recorded metadata: builder config,
Python version and content fingerprint for ``python_stdlib``, sizes and
seed for ``synthetic_domains``, version for TFDS datasets). A file lock
keeps concurrent processes from training twice; files appear atomically.

Deterministic: the same corpus and settings give a byte-identical
``tokenizer.json`` (``tests/data/test_bpe.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
from typing import Iterator, Optional, Sequence

import numpy as np

from moejax.data.documents import SEPARATOR_ID, Document, Documents

SEPARATOR_TOKEN = "<|sep|>"
MIN_FREQUENCY = 2
CACHE_DIR = "moejax_tokenizers"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
# Bump when a change here changes the trained tokenizer or the encoded ids.
FORMAT_VERSION = 1
_ENCODE_CHUNK_BYTES = 1 << 22   # spans handed to the Rust encoder at once


def _byte_to_char() -> dict[int, str]:
  """GPT-2's ``bytes_to_unicode``: the printable character ByteLevel uses for each byte."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b], extra = chr(256 + extra), extra + 1
  return table


CHAR_TO_BYTE = {c: b for b, c in _byte_to_char().items()}


def settings(vocab_size: int) -> dict:
  """What, besides the corpus, determines the trained tokenizer."""
  return {"algorithm": "byte-level BPE (tokenizers ByteLevel + BpeTrainer)",
          "vocab_size": int(vocab_size), "min_frequency": MIN_FREQUENCY,
          "separator": SEPARATOR_TOKEN, "pre_split": "domain spans",
          "format": FORMAT_VERSION}


# --- domain spans -----------------------------------------------------------


def domain_spans(data: bytes, labels: np.ndarray) -> list[tuple[int, int, int]]:
  """(start, end, label) of the maximal one-label runs of a document.

  A cut that falls inside a UTF-8 character moves to that character's end,
  so each span decodes on its own; the span keeps its first byte's label.
  """
  labels = np.asarray(labels)
  if len(data) != len(labels):
    raise ValueError(f"{len(data)} bytes but {len(labels)} labels: give one label per byte")
  cuts = [0]
  for c in (np.flatnonzero(np.diff(labels)) + 1).tolist():
    while c < len(data) and data[c] & 0xC0 == 0x80:  # a UTF-8 continuation byte
      c += 1
    if c > cuts[-1] and c < len(data):
      cuts.append(c)
  cuts.append(len(data))
  return [(s, e, int(labels[s])) for s, e in zip(cuts[:-1], cuts[1:]) if e > s]


def _span_texts(doc: Document) -> Iterator[tuple[str, int]]:
  data = doc.tokens.tobytes()
  for s, e, label in domain_spans(data, doc.labels):
    try:
      yield data[s:e].decode("utf-8"), label
    except UnicodeDecodeError as err:
      raise ValueError(f"document {doc.name!r}: bytes {s}..{e} are not UTF-8 ({err}); the BPE "
                       f"tokenizer needs UTF-8 text (use data.tokenizer='bytes')") from err


# --- the tokenizer ----------------------------------------------------------


def train(docs: Documents, vocab_size: int) -> str:
  """The JSON of a byte-level BPE trained on the domain spans of ``docs`` (no caching)."""
  # Imported here: byte-level runs never load tokenizers.
  from tokenizers import (Tokenizer, decoders, models,  # pylint: disable=g-import-not-at-top
                          pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY,
                                special_tokens=[SEPARATOR_TOKEN], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  spans = (text for doc in docs for text, _ in _span_texts(doc))
  tok.train_from_iterator(spans, trainer=trainer)
  return tok.to_str(pretty=True)


class BpeTokenizer:
  """A trained byte-level BPE: encode documents to (ids, labels), decode ids to bytes.

  Attributes:
    json: the tokenizer file's text (``tokenizers.Tokenizer`` format).
    vocab_size: V, the configured size (>= the trained one).
    path: where it was loaded from ('' when in memory).
    hf: the ``tokenizers.Tokenizer``.
    pieces: the bytes of each id, V of them (the separator b"\\0", unused b"").
  """

  def __init__(self, json_text: str, vocab_size: int, path: str = ""):
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    self.json, self.vocab_size, self.path = json_text, int(vocab_size), path
    self.hf = Tokenizer.from_str(json_text)
    self.hf.encode_special_tokens = True  # '<|sep|>' in a text is text, not the separator
    where = path or "tokenizer"
    if self.hf.token_to_id(SEPARATOR_TOKEN) != SEPARATOR_ID:
      raise ValueError(f"{where}: {SEPARATOR_TOKEN!r} is not id {SEPARATOR_ID}")
    if self.hf.get_vocab_size() > self.vocab_size:
      raise ValueError(f"{where} has {self.hf.get_vocab_size()} ids, more than "
                       f"vocab_size={self.vocab_size}")
    pieces = [b""] * self.vocab_size
    for token, i in self.hf.get_vocab().items():
      pieces[i] = b"\0" if i == SEPARATOR_ID else bytes(CHAR_TO_BYTE[c] for c in token)
    self.pieces = tuple(pieces)

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self.json.encode("utf-8")).hexdigest()

  @property
  def token_bytes(self) -> np.ndarray:
    """int32[V] bytes per id (the separator 1, unused ids 0)."""
    return np.array([len(p) for p in self.pieces], np.int32)

  def encode_spans(self, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text, encoded on its own."""
    return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

  def encode(self, data: bytes, labels: Optional[np.ndarray] = None):
    """(uint16[n] ids, uint8[n] labels) of one document's bytes and per-byte labels."""
    labels = np.zeros(len(data), np.uint8) if labels is None else np.asarray(labels, np.uint8)
    doc = Document(np.frombuffer(data, np.uint8), labels)
    texts, span_labels = zip(*_span_texts(doc)) if len(data) else ((), ())
    ids = self.encode_spans(texts)
    counts = [len(x) for x in ids]
    return (np.fromiter((t for x in ids for t in x), np.uint16, count=sum(counts)),
            np.repeat(np.asarray(span_labels, np.uint8), counts))

  def decode(self, ids) -> bytes:
    """The bytes of ``ids`` (a separator decodes to byte 0): exact for any ids."""
    return b"".join(self.pieces[int(i)] for i in ids)


def encode_documents(docs: Documents, tok: BpeTokenizer) -> Documents:
  """``docs`` as BPE tokens, in memory: same names, order and domains; one label per token."""
  ids, labels, lengths = _encode_all(docs, tok)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  names = [d.name for d in docs]
  return _documents(docs, tok, ids, labels, offsets, names)


def _encode_all(docs: Documents, tok: BpeTokenizer):
  """uint16[T] ids, uint8[T] labels, int64[N] tokens per document."""
  ids, labels, lengths = [], [], np.zeros(len(docs), np.int64)
  texts, span_labels, span_doc, size = [], [], [], 0

  def flush():
    nonlocal texts, span_labels, span_doc, size
    if not texts:
      return
    enc = tok.encode_spans(texts)
    counts = np.array([len(x) for x in enc], np.int64)
    ids.append(np.fromiter((t for x in enc for t in x), np.uint16, count=int(counts.sum())))
    labels.append(np.repeat(np.asarray(span_labels, np.uint8), counts))
    np.add.at(lengths, np.asarray(span_doc, np.int64), counts)
    texts, span_labels, span_doc, size = [], [], [], 0

  for i, doc in enumerate(docs):
    for text, label in _span_texts(doc):
      texts.append(text), span_labels.append(label), span_doc.append(i)
      size += len(text)
    if size >= _ENCODE_CHUNK_BYTES:
      flush()
  flush()
  cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)
  return cat(ids, np.uint16), cat(labels, np.uint8), lengths


def _documents(raw: Documents, tok: BpeTokenizer, ids, labels, offsets, names) -> Documents:
  def get(i: int) -> Document:
    s, e = offsets[i], offsets[i + 1]
    return Document(ids[s:e], labels[s:e], str(names[i]))

  metadata = dict(raw.metadata, tokenizer=tokenizer_identity(tok))
  return Documents(name=raw.name, split=raw.split, domain_names=raw.domain_names,
                   length=len(offsets) - 1, get=get, metadata=metadata,
                   vocab_size=tok.vocab_size, token_bytes=tok.token_bytes)


def tokenizer_identity(tok: BpeTokenizer) -> dict:
  """What a result must record to name its tokenizer."""
  return {"tokenizer": "bpe", "bpe_vocab_size": tok.vocab_size,
          "trained_vocab_size": tok.hf.get_vocab_size(), "sha256": tok.sha256}


# --- the cache --------------------------------------------------------------


def corpus_identity(docs: Documents) -> dict:
  """A JSON-able identity of one split (what the cache key hashes)."""
  return {"name": docs.name, "split": docs.split, "documents": len(docs),
          "metadata": json.loads(json.dumps(docs.metadata, sort_keys=True, default=str))}


def cache_dir(data_dir: str, train_docs: Documents, vocab_size: int) -> str:
  """The directory of the tokenizer of ``train_docs`` at ``vocab_size`` (see module doc)."""
  key = json.dumps({"train": corpus_identity(train_docs), "settings": settings(vocab_size)},
                   sort_keys=True)
  digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
  dataset = re.sub(r"[^\w.\-]+", "_", train_docs.name)
  return os.path.join(data_dir, CACHE_DIR, dataset, f"bpe{vocab_size}-{digest}")


@contextlib.contextmanager
def _locked(directory: str):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, ".lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: str, data: bytes) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def load_or_train(data_dir: str, train_docs: Documents, vocab_size: int) -> BpeTokenizer:
  """The cached tokenizer of ``train_docs``; trained and written on first use only."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  directory = cache_dir(data_dir, train_docs, vocab_size)
  path = os.path.join(directory, TOKENIZER_FILE)
  if not os.path.exists(path):
    with _locked(directory):
      if not os.path.exists(path):
        text = train(train_docs, vocab_size)
        tok = BpeTokenizer(text, vocab_size, path)
        meta = {"settings": settings(vocab_size), "train": corpus_identity(train_docs),
                "tokenizers_version": tokenizers.__version__, **tokenizer_identity(tok)}
        _write_atomic(os.path.join(directory, META_FILE),
                      json.dumps(meta, indent=1, sort_keys=True).encode("utf-8"))
        _write_atomic(path, text.encode("utf-8"))
  with open(path, encoding="utf-8") as f:
    return BpeTokenizer(f.read(), vocab_size, path)


def encoded_split(data_dir: str, docs: Documents, tok: BpeTokenizer) -> Documents:
  """``docs`` encoded by ``tok``, cached next to the tokenizer (encoded once per split)."""
  directory = os.path.dirname(tok.path)
  key = hashlib.sha256(json.dumps([corpus_identity(docs), tok.sha256],
                                  sort_keys=True).encode("utf-8")).hexdigest()[:16]
  safe_split = re.sub(r"[^\w.\-]+", "_", docs.split)
  path = os.path.join(directory, f"{safe_split}-{key}.npz")
  if not os.path.exists(path):
    with _locked(directory):
      if not os.path.exists(path):
        ids, labels, lengths = _encode_all(docs, tok)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        buf = io.BytesIO()
        np.savez(buf, ids=ids, labels=labels, offsets=offsets,
                 names=np.array([d.name for d in docs], dtype=str))
        _write_atomic(path, buf.getvalue())
  with np.load(path, allow_pickle=False) as f:
    ids, labels, offsets, names = f["ids"], f["labels"], f["offsets"], f["names"]
  if len(offsets) != len(docs) + 1:
    raise ValueError(f"{path} holds {len(offsets) - 1} documents, {docs.name}/{docs.split} "
                     f"{len(docs)}: delete the file to re-encode")
  return _documents(docs, tok, ids, labels, offsets, names)
