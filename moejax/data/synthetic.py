"""A synthetic multi-domain corpus with known domains, for specialisation studies.

Legend: L bytes in one document.

Four generative processes, one per domain, each a different kind of skill so
that a router that specialises has something to specialise on:

- ``arithmetic`` (0): lines ``a op b op c=result`` over 0..99 with ``+ - *``
  and the usual precedence; the result is right, so it is learnable.
- ``markov`` (1): a first-order Markov chain over 16 capital letters whose
  sparse transition matrix is fixed by the corpus seed; lines of 64 letters.
- ``copy`` (2): ``<random lowercase word>|<the same word>`` lines; the second
  half is predictable only by copying (an induction-head task).
- ``language`` (3): sentences from a small English-like template grammar.

The alphabets barely overlap on purpose (digits and ``+-*=``; capitals;
lowercase with ``|``; lowercase with spaces and ``.``), so that byte statistics
alone tell the domains apart; the model still has to learn each process.

One document is one domain (document i has domain ``i % 4``, so domains are
balanced exactly); every byte of it carries that label. Each document is
generated from its own ``SeedSequence([seed, split, i])``, so the corpus is a
pure function of (seed, sizes) and never depends on generation order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from moejax.data import documents

SYNTHETIC_DOMAINS = ("arithmetic", "markov", "copy", "language")
_SPLIT_IDS = {"train": 0, "validation": 1}
_MARKOV_ALPHABET = b"ABCDEFGHIJKLMNOP"
_LOWER = b"abcdefghijklmnopqrstuvwxyz"
_GRAMMAR = {
    "det": ["the", "a", "every", "some", "no"],
    "adj": ["small", "red", "quiet", "old", "happy", "green", "tall"],
    "noun": ["cat", "dog", "bird", "child", "river", "tree", "robot", "king"],
    "verb": ["sees", "likes", "follows", "finds", "helps", "hears"],
    "adv": ["slowly", "often", "never", "again"],
}


def markov_matrix(seed: int) -> np.ndarray:
  """f64[16, 16] row-stochastic transitions: exactly 3 successors per letter."""
  rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6D61726B]))  # 'mark'
  n = len(_MARKOV_ALPHABET)
  p = np.zeros((n, n))
  for i in range(n):
    p[i, rng.choice(n, size=3, replace=False)] = np.exp(rng.normal(0.0, 0.7, size=3))
  return p / p.sum(axis=1, keepdims=True)


def _arithmetic_line(rng: np.random.Generator) -> bytes:
  n_ops = int(rng.integers(1, 3))
  terms = [str(int(rng.integers(0, 100)))]
  for _ in range(n_ops):
    terms += [str(rng.choice(["+", "-", "*"])), str(int(rng.integers(0, 100)))]
  expr = "".join(terms)
  # eval of digits and + - * only: the expression is built above, never read.
  return f"{expr}={eval(expr)}\n".encode()  # pylint: disable=eval-used


def _markov_line(rng: np.random.Generator, cumulative: np.ndarray) -> bytes:
  """64 letters; ``cumulative`` is the row-wise cumsum of :func:`markov_matrix`."""
  n = len(_MARKOV_ALPHABET)
  state = int(rng.integers(n))
  out = bytearray()
  for u in rng.random(64):
    out.append(_MARKOV_ALPHABET[state])
    state = int(np.searchsorted(cumulative[state], u, side="right"))
  return bytes(out) + b"\n"


def _copy_line(rng: np.random.Generator) -> bytes:
  word = bytes(rng.choice(list(_LOWER), size=int(rng.integers(4, 17))).tolist())
  return word + b"|" + word + b"\n"


def _language_line(rng: np.random.Generator) -> bytes:
  pick = lambda k: _GRAMMAR[k][int(rng.integers(len(_GRAMMAR[k])))]
  words = [pick("det")] + ([pick("adj")] if rng.random() < 0.5 else []) + [pick("noun")]
  words += ([pick("adv")] if rng.random() < 0.3 else []) + [pick("verb"), pick("det")]
  words += ([pick("adj")] if rng.random() < 0.5 else []) + [pick("noun")]
  return (" ".join(words) + ".\n").encode()


def generate_document(domain: int, rng: np.random.Generator, num_bytes: int,
                      cumulative: np.ndarray) -> bytes:
  """Whole lines of one domain until at least ``num_bytes`` bytes."""
  line = {
      0: lambda: _arithmetic_line(rng),
      1: lambda: _markov_line(rng, cumulative),
      2: lambda: _copy_line(rng),
      3: lambda: _language_line(rng),
  }[domain]
  out = bytearray()
  while len(out) < num_bytes:
    out += line()
  return bytes(out)


def generate_split(seed: int, split: str, num_docs: int, min_bytes: int, max_bytes: int):
  """Yields ``(key, data, domain)`` for the split's documents, in order."""
  matrix = markov_matrix(seed)
  cumulative = np.cumsum(matrix, axis=1)
  # Rounding must never select a zero-probability letter: from each row's
  # last possible successor on, the cumulative sum is exactly 1 (u < 1).
  last = matrix.shape[1] - 1 - np.argmax(matrix[:, ::-1] > 0, axis=1)
  cumulative[np.arange(matrix.shape[1]) >= last[:, None]] = 1.0
  for i in range(num_docs):
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_IDS[split], i]))
    domain = i % len(SYNTHETIC_DOMAINS)
    data = generate_document(domain, rng, int(rng.integers(min_bytes, max_bytes + 1)),
                             cumulative)
    yield f"{split}-{i:07d}", data, domain


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
  """Sizes and seed of the synthetic corpus (the seed fixes every byte)."""

  seed: int = 0
  num_train_docs: int = 2000
  num_val_docs: int = 200
  min_doc_bytes: int = 256
  max_doc_bytes: int = 2048


def config_for(seed: int = 0, num_train_docs: int = 2000, num_val_docs: int = 200,
               min_doc_bytes: int = 256, max_doc_bytes: int = 2048) -> SyntheticConfig:
  """A config whose name spells out every parameter, so different corpora
  never share a directory."""
  name = f"s{seed}-n{num_train_docs}-v{num_val_docs}-b{min_doc_bytes}-{max_doc_bytes}"
  return SyntheticConfig(name=name, seed=seed, num_train_docs=num_train_docs,
                         num_val_docs=num_val_docs, min_doc_bytes=min_doc_bytes,
                         max_doc_bytes=max_doc_bytes)


class SyntheticDomains(tfds.core.GeneratorBasedBuilder):
  """TFDS builder ``synthetic_domains``: four labelled generative processes."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "arithmetic, markov, copy, language domains."}
  BUILDER_CONFIGS = [config_for()]
  DOMAIN_NAMES = SYNTHETIC_DOMAINS
  code_path = None  # see PythonStdlib.code_path: nothing to download

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__, features=documents.document_features(),
        metadata=tfds.core.MetadataDict(), disable_shuffling=True)

  def _split_generators(self, dl_manager):
    del dl_manager
    cfg = self.builder_config
    self.info.metadata.update({
        "seed": cfg.seed, "domain_names": list(SYNTHETIC_DOMAINS),
        "num_train_docs": cfg.num_train_docs, "num_val_docs": cfg.num_val_docs})
    return {"train": self._generate_examples("train", cfg.num_train_docs),
            "validation": self._generate_examples("validation", cfg.num_val_docs)}

  def _generate_examples(self, split: str, num_docs: int):
    cfg = self.builder_config
    for key, data, domain in generate_split(cfg.seed, split, num_docs, cfg.min_doc_bytes,
                                            cfg.max_doc_bytes):
      yield key, {"tokens": np.frombuffer(data, np.uint8),
                  "labels": np.full(len(data), domain, np.uint8), "name": key}
