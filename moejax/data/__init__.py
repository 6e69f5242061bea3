"""moejax.data: byte-level or subword datasets, domain labels, packed resumable batches.

The whole API::

    from moejax import data
    cfg = data.DataConfig(name="python_stdlib", seq_len=256, batch_size=16, seed=0)
    train = data.make_batches(cfg, "train")          # infinite, shuffled per epoch
    batch = next(train)   # inputs/targets/labels/segment_ids/doc_ids/mask/valid/target_bytes
    state = train.get_state()                        # small JSON-able dict; checkpoint it
    train = data.make_batches(cfg, "train", state=state)   # resumes exactly
    for batch in data.make_batches(cfg, "validation"):     # one deterministic pass
      ...
    docs = data.get_dataset("python_stdlib", "train", data_dir)  # the Documents themselves
    bpe = data.DataConfig(tokenizer="bpe", bpe_vocab_size=4096)  # subword tokens instead
    data.vocab_size(bpe)                             # 4096: the model's vocab_size

Token ids are bytes, vocab 256 (``tokenizer='bytes'``, the default), or
byte-level BPE ids trained on the dataset's train split and cached under
``data_dir`` (``tokenizer='bpe'``, vocab ``bpe_vocab_size``; see
``moejax/data/bpe.py``); :func:`vocab_size` says which, from the config
alone. Id 0 separates documents (``SEPARATOR_ID``). Batches carry
``target_bytes``, the bytes each target stands for, so losses are reported
per byte as well as per token. ``docs.domain_names`` says what the labels
mean (one label per token): ``python_stdlib``: code, comment, docstring,
string; ``synthetic_domains``: arithmetic, markov, copy, language; TFDS text
datasets: text.
"""

from __future__ import annotations

from typing import Optional

from moejax.data.config import (BUILTIN_NAMES, TOKENIZERS, DataConfig, check_vocab_size,
                                domain_names, vocab_size)
from moejax.data.datasets import (BUILTIN_DATASETS, DatasetUnavailableError, available_datasets,
                                  builtin_builder, get_dataset, resolve_data_dir)
from moejax.data.documents import SEPARATOR_ID, VOCAB_SIZE, Document, Documents
from moejax.data.labels import (CODE, COMMENT, DOCSTRING, PYTHON_DOMAINS, STRING, LabelError,
                                label_python_source, label_spans)
from moejax.data.packing import BatchIterator, make_batch_iterator
from moejax.data.stats import domain_fractions, token_counts, unigram_cross_entropy
from moejax.data.stdlib import PythonStdlib, StdlibConfig
from moejax.data.synthetic import SYNTHETIC_DOMAINS, SyntheticConfig, SyntheticDomains


def load_documents(cfg: DataConfig, split: str) -> Documents:
  """The documents of ``split`` of the dataset ``cfg`` names.

  With ``cfg.tokenizer='bpe'`` they are BPE tokens (one label per token);
  the first call trains the tokenizer on ``cfg.train_split`` and caches it,
  and each split's encoding, under ``data_dir``.

  Raises DatasetUnavailableError (absent TFDS dataset, unknown split) before
  any batch is built.
  """
  docs = _raw_documents(cfg, split)
  if cfg.tokenizer == "bytes":
    return docs
  from moejax.data import bpe  # pylint: disable=g-import-not-at-top
  data_dir = resolve_data_dir(cfg.data_dir)
  return bpe.encoded_split(data_dir, docs, load_tokenizer(cfg))


def _raw_documents(cfg: DataConfig, split: str) -> Documents:
  return get_dataset(cfg.name, split, cfg.data_dir, config=cfg.builder_config(),
                     download=cfg.download, text_key=cfg.text_key)


def load_tokenizer(cfg: DataConfig):
  """The :class:`moejax.data.bpe.BpeTokenizer` of ``cfg`` (``tokenizer='bpe'`` only).

  Trained on ``cfg.train_split`` on first use, then read from the cache.
  """
  if cfg.tokenizer != "bpe":
    raise ValueError(f"data.tokenizer={cfg.tokenizer!r} has no trained vocabulary; "
                     f"load_tokenizer needs data.tokenizer='bpe'")
  from moejax.data import bpe  # pylint: disable=g-import-not-at-top
  return bpe.load_or_train(resolve_data_dir(cfg.data_dir), _raw_documents(cfg, cfg.train_split),
                           cfg.bpe_vocab_size)


def tokenizer_identity(cfg: DataConfig) -> dict:
  """What a result records to name its tokenizer (trains the BPE if not cached yet).

  ``{"tokenizer": "bytes"}``, or for BPE the configured and trained vocab
  sizes and the SHA-256 of the tokenizer file.
  """
  if cfg.tokenizer == "bytes":
    return {"tokenizer": "bytes"}
  from moejax.data import bpe  # pylint: disable=g-import-not-at-top
  return bpe.tokenizer_identity(load_tokenizer(cfg))


def loss_labels(cfg: DataConfig, docs: Documents) -> Optional[tuple[int, ...]]:
  """The label values ``cfg.loss_domains`` names in ``docs`` (None: every domain is scored)."""
  if not cfg.loss_domains:
    return None
  missing = [d for d in cfg.loss_domains if d not in docs.domain_names]
  if missing:
    raise ValueError(f"data.loss_domains={cfg.loss_domains}: {missing} not among the domains "
                     f"{docs.domain_names} of {docs.name}/{docs.split}")
  return tuple(docs.domain_names.index(d) for d in cfg.loss_domains)


def make_batches(cfg: DataConfig, split: str, *, train: Optional[bool] = None,
                 state: Optional[dict] = None, process_index: int = 0,
                 process_count: int = 1) -> BatchIterator:
  """Packed batches of ``split``: see :class:`BatchIterator` for the arrays.

  Args:
    cfg: the data config.
    split: a split name, usually ``cfg.train_split`` or ``cfg.eval_split``.
    train: infinite shuffled epochs (True) or one ordered pass (False);
      default: whether ``split`` is ``cfg.train_split``.
    state: a ``get_state()`` dict to resume from.
    process_index / process_count: this process's share of each global batch
      (``jax.process_index()``, ``jax.process_count()``).
  """
  docs = load_documents(cfg, split)
  return make_batch_iterator(docs, cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                             train=split == cfg.train_split if train is None else train,
                             state=state, process_index=process_index,
                             process_count=process_count, loss_labels=loss_labels(cfg, docs))


__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_NAMES", "BatchIterator", "CODE", "COMMENT", "DOCSTRING",
    "DataConfig", "DatasetUnavailableError", "Document", "Documents", "LabelError",
    "PYTHON_DOMAINS", "PythonStdlib", "SEPARATOR_ID", "STRING", "SYNTHETIC_DOMAINS",
    "StdlibConfig", "SyntheticConfig", "SyntheticDomains", "TOKENIZERS", "VOCAB_SIZE",
    "available_datasets", "builtin_builder", "check_vocab_size", "domain_fractions",
    "domain_names", "get_dataset", "label_python_source", "label_spans", "load_documents",
    "load_tokenizer", "loss_labels", "make_batch_iterator", "make_batches", "resolve_data_dir",
    "token_counts", "tokenizer_identity", "unigram_cross_entropy", "vocab_size",
]
