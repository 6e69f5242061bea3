"""moejax.data: byte-level datasets, domain labels, packed resumable batches.

The whole API::

    from moejax import data
    cfg = data.DataConfig(name="python_stdlib", seq_len=256, batch_size=16, seed=0)
    train = data.make_batches(cfg, "train")          # infinite, shuffled per epoch
    batch = next(train)                              # inputs/targets/labels/segment_ids/mask
    state = train.get_state()                        # small JSON-able dict; checkpoint it
    train = data.make_batches(cfg, "train", state=state)   # resumes exactly
    for batch in data.make_batches(cfg, "validation"):     # one deterministic pass
      ...
    docs = data.get_dataset("python_stdlib", "train", data_dir)  # the Documents themselves

Token ids are bytes, vocab 256; byte 0 separates documents
(``SEPARATOR_ID``). ``docs.domain_names`` says what the labels mean:
``python_stdlib``: code, comment, docstring, string; ``synthetic_domains``:
arithmetic, markov, copy, language; TFDS text datasets: text.
"""

from __future__ import annotations

from typing import Optional

from moejax.data.config import BUILTIN_NAMES, DataConfig
from moejax.data.datasets import (BUILTIN_DATASETS, DatasetUnavailableError, available_datasets,
                                  builtin_builder, get_dataset, resolve_data_dir)
from moejax.data.documents import SEPARATOR_ID, VOCAB_SIZE, Document, Documents
from moejax.data.labels import (CODE, COMMENT, DOCSTRING, PYTHON_DOMAINS, STRING, LabelError,
                                label_python_source, label_spans)
from moejax.data.packing import BatchIterator, make_batch_iterator
from moejax.data.stats import byte_counts, domain_fractions, unigram_cross_entropy
from moejax.data.stdlib import PythonStdlib, StdlibConfig
from moejax.data.synthetic import SYNTHETIC_DOMAINS, SyntheticConfig, SyntheticDomains


def load_documents(cfg: DataConfig, split: str) -> Documents:
  """The documents of ``split`` of the dataset ``cfg`` names.

  Raises DatasetUnavailableError (absent TFDS dataset, unknown split) before
  any batch is built.
  """
  return get_dataset(cfg.name, split, cfg.data_dir, config=cfg.builder_config(),
                     download=cfg.download, text_key=cfg.text_key)


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
                             process_count=process_count)


__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_NAMES", "BatchIterator", "CODE", "COMMENT", "DOCSTRING",
    "DataConfig", "DatasetUnavailableError", "Document", "Documents", "LabelError",
    "PYTHON_DOMAINS", "PythonStdlib", "SEPARATOR_ID", "STRING", "SYNTHETIC_DOMAINS",
    "StdlibConfig", "SyntheticConfig", "SyntheticDomains", "VOCAB_SIZE", "available_datasets",
    "builtin_builder", "byte_counts", "domain_fractions", "get_dataset", "label_python_source", "label_spans", "load_documents",
    "make_batch_iterator", "make_batches", "resolve_data_dir", "unigram_cross_entropy",
]
