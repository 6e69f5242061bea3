"""Corpus statistics a training run compares against.

The unigram baseline is the loss of a model that ignores context: the
cross-entropy of the evaluation stream under the training stream's token
(byte, or BPE id) frequencies. A language model that learns anything beats
it; the README's "validation loss falls clearly below the unigram baseline"
reads this number.
Streams include the separator before each document, as the packer feeds them.
"""

from __future__ import annotations

import numpy as np

from moejax.data.documents import SEPARATOR_ID, Documents


def token_counts(docs: Documents) -> np.ndarray:
  """int64[V] token counts of the packed stream (separators included)."""
  counts = np.zeros(docs.vocab_size, np.int64)
  for d in docs:
    counts += np.bincount(d.tokens, minlength=docs.vocab_size)
  counts[SEPARATOR_ID] += len(docs)
  return counts



def unigram_cross_entropy(train: Documents, evaluation: Documents, smoothing: float = 1.0) -> float:
  """Nats per token of ``evaluation`` under add-``smoothing`` unigrams of ``train``."""
  p = token_counts(train) + smoothing
  p = p / p.sum()
  q = token_counts(evaluation)
  return float(-(q * np.log(p)).sum() / q.sum())


def domain_fractions(docs: Documents) -> dict[str, float]:
  """Share of tokens (bytes, at byte level) per domain name."""
  counts = np.zeros(len(docs.domain_names), np.int64)
  for d in docs:
    counts += np.bincount(d.labels, minlength=len(docs.domain_names))
  total = max(int(counts.sum()), 1)
  return {name: float(c) / total for name, c in zip(docs.domain_names, counts)}
