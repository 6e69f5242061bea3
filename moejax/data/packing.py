"""Packing documents into fixed-length batches, with a resumable iterator.

Legend: B batch rows (global, over all processes), S sequence length,
N documents, T tokens in the packed stream.

The packed stream of a split is its documents in an order, each preceded by
the separator (byte 0, see ``documents.SEPARATOR_ID``): ``0 d0 0 d1 0 d2 ...``
of T = sum(len(d) + 1) tokens. A row is a window of S + 1 stream tokens;
``inputs`` are its first S, ``targets`` its last S.

Train (``train=True``), infinite: epoch e orders the documents by a
permutation drawn from ``SeedSequence([seed, e])``. Its stream is cut into B
lanes of L = T // B tokens; row b of batch k is tokens ``[k S, k S + S + 1)``
of lane b. So the rows of one batch come from B far-apart places (B different
documents, unless one document is longer than a lane: tiny_shakespeare is
one), which a single stream cut into consecutive rows would not give; and
every target of an epoch is seen once, except at most S per lane at its end.
An epoch has R = (L - 1) // S batches, the same for every epoch.

Validation (``train=False``), one pass: documents in their stored order, one
stream, row r = tokens ``[r S, r S + S + 1)``, batch k = rows ``kB .. kB+B-1``.
Every target is scored exactly once; the last batch is padded with rows
whose ``mask`` is False (static shapes for jit).

State: ``{"epoch", "step"}`` (batch index within the epoch) plus the
identity of the stream (seed, S, B, N, T, train), as a small JSON-able dict;
``set_state`` resumes exactly, and refuses a state of another stream.

Processes: with ``process_count`` P, process p yields rows
``[p B/P, (p+1) B/P)`` of each global batch and reads only those.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from moejax.data.documents import SEPARATOR_ID, Documents

_DOC_CACHE = 64


class BatchIterator:
  """Iterator of packed batches over :class:`Documents`.

  Each batch is a dict of numpy arrays, local rows only (B/P of them):
    inputs: int32[B/P, S] token ids.
    targets: int32[B/P, S] next tokens (inputs shifted by one).
    labels: int32[B/P, S] domain of each *target* (index into
      ``domain_names``); a separator takes the domain of the byte after it,
      i.e. of the document it opens.
    segment_ids: int32[B/P, S] 1, 2, ... numbering the documents that the
      *inputs* of a row belong to (a separator belongs to the document it
      opens); 0 on padding. For document-masked attention if wanted.
    doc_ids: int32[B/P, S] index into ``docs`` of the document each *target*
      belongs to (a separator target to the document it opens, like its
      label); -1 on padding. Per-document validation losses sum over it.
    mask: bool[B/P, S] the targets that are scored: False on padding and,
      with ``loss_labels``, on targets whose label is not one of them.
    valid: bool[B/P, S] False only where the target is padding (equal to
      ``mask`` without ``loss_labels``): what routing statistics count.
    target_bytes: int32[B/P, S] the bytes each target stands for
      (``Documents.bytes_per_token``: 1 at byte level, the separator 1, a
      BPE token its UTF-8 length), 0 on padding; a loss summed over targets
      divided by its sum is nats per byte (of the scored targets).

  ``loss_labels``: label values whose targets are scored (``mask``); None:
  every label (:func:`moejax.data.loss_labels` turns ``data.loss_domains``
  into them).
  """

  def __init__(self, docs: Documents, seq_len: int, batch_size: int, *, seed: int = 0,
               train: bool = True, process_index: int = 0, process_count: int = 1,
               loss_labels: Optional[tuple] = None):
    if seq_len <= 0 or batch_size <= 0:
      raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}: both must be > 0")
    if process_count <= 0 or not 0 <= process_index < process_count or batch_size % process_count:
      raise ValueError(f"process_index={process_index}, process_count={process_count}, "
                       f"batch_size={batch_size}: need 0 <= index < count dividing batch_size")
    if len(docs) == 0:
      raise ValueError(f"{docs.name}/{docs.split} has no documents")
    self.docs, self.seq_len, self.batch_size = docs, seq_len, batch_size
    self.seed, self.train = int(seed), bool(train)
    self.loss_labels = None if loss_labels is None else np.asarray(sorted(loss_labels), np.int32)
    local = batch_size // process_count
    self._rows = range(process_index * local, (process_index + 1) * local)
    self._stream_lens = docs.lengths + 1
    self._token_bytes = docs.bytes_per_token()
    self.num_tokens = int(self._stream_lens.sum())
    if train:
      self.lane_len = self.num_tokens // batch_size
      self.steps_per_epoch = (self.lane_len - 1) // seq_len
      if self.steps_per_epoch < 1:
        raise ValueError(
            f"{docs.name}/{docs.split} packs to {self.num_tokens} tokens, fewer than "
            f"batch_size * (seq_len + 1) = {batch_size * (seq_len + 1)}; lower batch_size or seq_len")
    else:
      rows = -(-(self.num_tokens - 1) // seq_len)
      self.steps_per_epoch = -(-rows // batch_size)
    self.epoch, self.step = 0, 0
    self._order_epoch, self._order, self._cum = None, None, None
    self._cache: collections.OrderedDict = collections.OrderedDict()

  # --- state ---------------------------------------------------------------

  def _identity(self) -> dict:
    return {"seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size,
            "num_docs": len(self.docs), "num_tokens": self.num_tokens, "train": self.train}

  def get_state(self) -> dict:
    """A small JSON-able dict; :meth:`set_state` on it resumes exactly."""
    return {"epoch": self.epoch, "step": self.step, **self._identity()}

  def set_state(self, state: dict) -> None:
    for key, want in self._identity().items():
      if key in state and state[key] != want:
        raise ValueError(f"iterator state has {key}={state[key]!r} but this iterator has "
                         f"{key}={want!r}: it belongs to another data stream (dataset, split "
                         f"or DataConfig changed); restore with the same data config")
    self.epoch, self.step = int(state["epoch"]), int(state["step"])

  # --- reading the stream --------------------------------------------------

  def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Document order of ``epoch`` and int64[N + 1] stream offsets in it."""
    if self._order_epoch != epoch:
      n = len(self.docs)
      if self.train:
        order = np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
      else:
        order = np.arange(n)
      self._order = order
      self._cum = np.concatenate([[0], np.cumsum(self._stream_lens[order])])
      self._order_epoch = epoch
    return self._order, self._cum

  def _doc(self, i: int):
    if i in self._cache:
      self._cache.move_to_end(i)
      return self._cache[i]
    doc = self.docs[int(i)]
    self._cache[i] = doc
    if len(self._cache) > _DOC_CACHE:
      self._cache.popitem(last=False)
    return doc

  def _read(self, epoch: int, start: int, n: int):
    """Stream tokens ``[start, start + n)`` of ``epoch`` (cut at the stream's end).

    Returns tokens, labels, segment numbers and document indices, each
    int32[n] (zero past the end; -1 for the indices), and how many tokens
    were real.
    """
    order, cum = self._epoch_order(epoch)
    tokens, labels, segs = (np.zeros(n, np.int32) for _ in range(3))
    doc_ids = np.full(n, -1, np.int32)
    pos, filled, seg = start, 0, 0
    j = int(np.searchsorted(cum, start, side="right")) - 1
    while filled < n and j < len(order):
      doc = self._doc(order[j])
      off = pos - cum[j]
      k = min(n - filled, int(cum[j + 1] - pos))
      seg += 1
      out = slice(filled, filled + k)
      if off == 0:  # the separator that opens this document
        tokens[filled] = SEPARATOR_ID
        labels[filled] = doc.labels[0] if len(doc.labels) else 0
        tokens[filled + 1:filled + k] = doc.tokens[:k - 1]
        labels[filled + 1:filled + k] = doc.labels[:k - 1]
      else:
        tokens[out] = doc.tokens[off - 1:off - 1 + k]
        labels[out] = doc.labels[off - 1:off - 1 + k]
      segs[out] = seg
      doc_ids[out] = order[j]
      filled, pos, j = filled + k, pos + k, j + 1
    return tokens, labels, segs, doc_ids, filled

  def _row_start(self, row: int) -> int:
    if self.train:
      return row * self.lane_len + self.step * self.seq_len
    return (self.step * self.batch_size + row) * self.seq_len

  # --- iteration -----------------------------------------------------------

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.train and self.step >= self.steps_per_epoch:
      self.epoch, self.step = self.epoch + 1, 0
    if not self.train and self.step >= self.steps_per_epoch:
      raise StopIteration
    S = self.seq_len
    out = {k: np.zeros((len(self._rows), S), np.int32)
           for k in ("inputs", "targets", "labels", "segment_ids")}
    out["doc_ids"] = np.full((len(self._rows), S), -1, np.int32)
    out["mask"] = np.zeros((len(self._rows), S), bool)
    for i, row in enumerate(self._rows):
      tokens, labels, segs, doc_ids, filled = self._read(self.epoch, self._row_start(row), S + 1)
      n_targets = max(filled - 1, 0)
      out["inputs"][i], out["targets"][i] = tokens[:S], tokens[1:]
      out["labels"][i], out["segment_ids"][i] = labels[1:], segs[:S]
      out["doc_ids"][i] = doc_ids[1:]
      out["mask"][i, :n_targets] = True
    out["valid"] = out["mask"].copy()
    if self.loss_labels is not None:
      out["mask"] &= np.isin(out["labels"], self.loss_labels)
    out["target_bytes"] = self._token_bytes[out["targets"]] * out["mask"]
    self.step += 1
    return out

  def __len__(self) -> int:
    """Batches per epoch (the whole pass for validation)."""
    return self.steps_per_epoch


def make_batch_iterator(docs: Documents, seq_len: int, batch_size: int, *, seed: int = 0,
                        train: bool = True, state: Optional[dict] = None, process_index: int = 0,
                        process_count: int = 1,
                        loss_labels: Optional[tuple] = None) -> BatchIterator:
  """A :class:`BatchIterator`, resumed from ``state`` when given."""
  it = BatchIterator(docs, seq_len, batch_size, seed=seed, train=train,
                     process_index=process_index, process_count=process_count,
                     loss_labels=loss_labels)
  if state is not None:
    it.set_state(state)
  return it
