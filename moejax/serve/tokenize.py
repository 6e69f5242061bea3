"""Text <-> token ids for generation, behind one function: :func:`get_tokenizer`.

Byte level (``data.tokenizer='bytes'``, vocab 256): id 0 separates
documents (the packed stream is ``0 d0 0 d1 ...``, see moejax.data.packing),
so a prompt is encoded as ``0`` (the separator that opens a document) then
its UTF-8 bytes, and generation stops when the model emits ``0`` (it has
ended the document). Subword (``data.tokenizer='bpe'``): the run's own
trained vocabulary (:func:`moejax.data.load_tokenizer`), whose id 0 is the
same document separator, so prompts open and generation stops the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from moejax.config import ConfigError
from moejax.data import SEPARATOR_ID, VOCAB_SIZE

# The data-config field that names the tokenizer (absent today: bytes).
FIELD_TOKENIZER = "data.tokenizer"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """encode(text) -> ids (with the document-opening token, if any); decode(ids) -> text.

  stop_id: the token that ends a document (generation stops after it), or None.
  """

  name: str
  vocab_size: int
  encode_fn: Callable[[str], list[int]]
  decode_fn: Callable[[Sequence[int]], str]
  bos_id: Optional[int] = None
  stop_id: Optional[int] = None

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ids = self.encode_fn(text)
    return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.decode_fn([int(i) for i in ids])


def _byte_encode(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def _byte_decode(ids: Sequence[int]) -> str:
  # A sampled byte sequence need not be valid UTF-8 (a multi-byte character
  # cut by the length limit): show replacement characters, never fail.
  return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


BYTES = Tokenizer("bytes", VOCAB_SIZE, _byte_encode, _byte_decode, bos_id=SEPARATOR_ID,
                  stop_id=SEPARATOR_ID)


def _bpe(data_cfg: Any) -> Tokenizer:
  """The run's trained BPE (read from the cache next to its data; trained there if absent)."""
  from moejax import data as data_lib  # pylint: disable=g-import-not-at-top
  bpe = data_lib.load_tokenizer(data_cfg)

  def encode(text: str) -> list[int]:
    ids, _ = bpe.encode(text.encode("utf-8"))
    return [int(i) for i in ids]

  def decode(ids: Sequence[int]) -> str:
    return bpe.decode([i for i in ids if 0 <= i < bpe.vocab_size]).decode("utf-8",
                                                                           errors="replace")

  return Tokenizer(f"bpe{bpe.vocab_size}", bpe.vocab_size, encode, decode,
                   bos_id=SEPARATOR_ID, stop_id=SEPARATOR_ID)


def get_tokenizer(data_cfg: Any = None, vocab_size: Optional[int] = None) -> Tokenizer:
  """The tokenizer of a run's data config (``data.tokenizer``; bytes when absent).

  vocab_size: the model's; checked against the tokenizer's so a model is
  never fed ids it has no embedding for.
  """
  name = getattr(data_cfg, "tokenizer", None) or "bytes"
  if name in ("bytes", "byte"):
    tok = BYTES
  elif name == "bpe":
    tok = _bpe(data_cfg)
  else:
    raise ConfigError(FIELD_TOKENIZER, name, "generation knows the bytes and bpe tokenizers",
                      "add the tokenizer as a branch of moejax.serve.tokenize.get_tokenizer")
  if vocab_size is not None and vocab_size < tok.vocab_size:
    raise ConfigError("model.vocab_size", vocab_size,
                      f"is smaller than the {tok.name} tokenizer's {tok.vocab_size} ids",
                      f"use a model with vocab_size >= {tok.vocab_size}")
  return tok
