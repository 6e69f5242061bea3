"""Documents: the unit every dataset yields and the packer consumes.

Legend: L bytes (tokens) in one document, N documents in a split.

Token ids are bytes (0..255). Byte 0 doubles as the document separator
(``SEPARATOR_ID``): Python source cannot contain NUL bytes, the synthetic
corpus never emits one, and UTF-8 text practically never does, so the model
keeps ``ModelConfig.vocab_size = 256`` and needs no extra id.

A dataset's domain labels are small ints indexing its ``domain_names``; every
byte of a document carries one (uint8[L]).

Subword documents (``DataConfig.tokenizer='bpe'``, ``moejax/data/bpe.py``)
have the same shape with BPE ids (uint16) in place of bytes, one label per
token, ``vocab_size`` V and ``token_bytes`` (how many bytes each id stands
for), so that losses can be reported per byte as well as per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow_datasets as tfds

SEPARATOR_ID = 0
VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: tokens uint8[L], labels uint8[L] and a name (path, key)."""

  tokens: np.ndarray
  labels: np.ndarray
  name: str = ""


@dataclasses.dataclass(frozen=True)
class Documents:
  """A random-access split of documents, read lazily.

  Attributes:
    name: the dataset name (``python_stdlib``, ``tiny_shakespeare``, ...).
    split: the split name.
    domain_names: what each label value means; labels index this tuple.
    length: N, the number of documents.
    get: ``i -> Document`` for ``0 <= i < N``, in the split's fixed order.
    metadata: what the dataset recorded about itself (Python version, file
      counts, seed, ...); plain JSON-able values.
    vocab_size: V, token ids lie in [0, V).
    token_bytes: int32[V], the bytes each token id stands for (the separator
      counts 1, as byte 0 does); None means one byte per id (byte level).
  """

  name: str
  split: str
  domain_names: tuple[str, ...]
  length: int
  get: Callable[[int], Document]
  metadata: dict = dataclasses.field(default_factory=dict)
  vocab_size: int = VOCAB_SIZE
  token_bytes: Optional[np.ndarray] = None

  def bytes_per_token(self) -> np.ndarray:
    """int32[V] the bytes each token id stands for (all ones at byte level)."""
    if self.token_bytes is None:
      return np.ones(self.vocab_size, np.int32)
    return np.asarray(self.token_bytes, np.int32)

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, i: int) -> Document:
    if not -self.length <= i < self.length:
      raise IndexError(f"document {i} out of range for {self.length} documents")
    return self.get(i % self.length)

  def __iter__(self):
    return (self.get(i) for i in range(self.length))

  @functools.cached_property
  def lengths(self) -> np.ndarray:
    """int64[N] tokens (bytes, at byte level) per document; reads every document once, then cached."""
    return np.fromiter((len(d.tokens) for d in self), np.int64, count=self.length)

  def num_tokens(self) -> int:
    """Total tokens (bytes, at byte level) over all documents."""
    return int(self.lengths.sum())

  @classmethod
  def from_arrays(
      cls,
      tokens: Sequence[Sequence[int] | bytes | np.ndarray],
      labels: Optional[Sequence[Sequence[int] | np.ndarray]] = None,
      domain_names: tuple[str, ...] = ("text",),
      name: str = "in_memory",
      split: str = "train",
      names: Optional[Sequence[str]] = None,
  ) -> "Documents":
    """In-memory documents (hand-made corpora in tests, notebooks).

    ``tokens[i]`` may be ``bytes`` or a sequence of ints in [0, 256); missing
    labels are all 0.
    """
    docs = []
    for i, t in enumerate(tokens):
      t = np.frombuffer(t, np.uint8) if isinstance(t, (bytes, bytearray)) else np.asarray(t)
      if t.ndim != 1 or (t.size and (t.min() < 0 or t.max() >= VOCAB_SIZE)):
        raise ValueError(f"tokens[{i}] must be 1-D byte ids in [0, {VOCAB_SIZE}); got shape "
                         f"{t.shape}, range [{t.min() if t.size else None}, {t.max() if t.size else None}]")
      lab = np.zeros(t.size, np.uint8) if labels is None else np.asarray(labels[i], np.uint8)
      if lab.shape != t.shape:
        raise ValueError(f"labels[{i}] has shape {lab.shape}, tokens[{i}] {t.shape}: give one label per byte")
      if lab.size and lab.max() >= len(domain_names):
        raise ValueError(f"labels[{i}] holds {lab.max()}, but only {len(domain_names)} domain_names")
      docs.append(Document(t.astype(np.uint8), lab, names[i] if names else str(i)))
    return cls(name=name, split=split, domain_names=tuple(domain_names), length=len(docs),
               get=docs.__getitem__)


def document_features() -> tfds.features.FeaturesDict:
  """The TFDS feature spec of the builders in this package.

  ZLIB-encoded uint8 tensors: raw bytes on disk (not int64 lists, 8x larger),
  compressed (source code and its labels shrink ~6x), decoded with numpy, no
  TensorFlow.
  """
  seq = lambda: tfds.features.Tensor(shape=(None,), dtype=np.uint8,
                                     encoding=tfds.features.Encoding.ZLIB)
  return tfds.features.FeaturesDict({"tokens": seq(), "labels": seq(), "name": tfds.features.Text()})


def from_data_source(source, name: str, split: str, domain_names: tuple[str, ...],
                     metadata: dict) -> Documents:
  """Documents over a TFDS random-access source of :func:`document_features`."""

  def get(i: int) -> Document:
    ex = source[i]
    doc_name = ex["name"]
    return Document(np.asarray(ex["tokens"], np.uint8), np.asarray(ex["labels"], np.uint8),
                    doc_name.decode("utf-8") if isinstance(doc_name, bytes) else str(doc_name))

  return Documents(name=name, split=split, domain_names=tuple(domain_names), length=len(source),
                   get=get, metadata=dict(metadata))
