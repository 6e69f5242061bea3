"""DataConfig: which dataset, where, and how it is batched; validated early.

Build it like the other moejax configs (``moejax.config.from_dict(DataConfig,
{...}, "data")``); every failure is a :class:`moejax.config.ConfigError`
naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from moejax.config import ConfigError, check_choice
from moejax.data import names

BUILTIN_NAMES = ("python_stdlib", "synthetic_domains")
# The splits the built-in builders generate (stdlib / synthetic _split_generators; not
# imported: config stays TFDS-free; a test checks they agree).
BUILTIN_SPLITS = ("train", "validation")
TOKENIZERS = ("bytes", "bpe")
BYTE_VOCAB_SIZE = 256        # == documents.VOCAB_SIZE (not imported: config stays TFDS-free)
BPE_MIN_VOCAB_SIZE = 257     # the separator and the 256 bytes, before any merge
BPE_MAX_VOCAB_SIZE = 65536   # ids are stored as uint16
# Domain names of the built-in datasets' labels (== labels.PYTHON_DOMAINS and
# synthetic.SYNTHETIC_DOMAINS, not imported: config stays TFDS-free; a test
# checks they agree); TFDS text datasets have the one domain ``text``.
DOMAINS = {"python_stdlib": ("code", "comment", "docstring", "string"),
           "synthetic_domains": ("arithmetic", "markov", "copy", "language")}
TEXT_DOMAINS = ("text",)
# 'dataset', 'dataset/config', 'dataset:1.0.0', 'dataset/config:1.0.0' (TFDS).
_TFDS_NAME = re.compile(r"^[a-zA-Z]\w*(/[\w+\-.]+)?(:\d+\.\d+\.\d+)?$")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The data pipeline.

  Attributes:
    name: ``python_stdlib`` (default, offline), ``synthetic_domains``, or any
      TFDS text dataset name (``tiny_shakespeare``, ``lm1b``, ...).
    data_dir: where prepared datasets live; None means the TFDS default
      (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
    seq_len: S, tokens per row (inputs and targets each).
    batch_size: B, rows per global batch (all processes together).
    seed: shuffles the documents of each training epoch.
    train_split / eval_split: split names (lm1b has no ``validation``: use
      ``test``).
    download: TFDS datasets only: prepare an absent one here (needs
      TensorFlow and a network); otherwise absent means a clear error.
    text_key: TFDS datasets only: the Text feature, when there are several.
    stdlib_max_files / stdlib_val_fraction / stdlib_include_tests:
      ``python_stdlib`` only (ignored otherwise): first n files only, share of
      files in validation, take the test suites too.
    synthetic_*: ``synthetic_domains`` only (ignored otherwise): corpus seed
      (fixes every byte), document counts, document size range in bytes.
    tokenizer: ``bytes`` (default: token ids are the UTF-8 bytes, vocab
      256) or ``bpe``: a byte-level BPE vocabulary trained once on this
      dataset's ``train_split`` and cached under ``data_dir``
      (``moejax/data/bpe.py``). The model's ``vocab_size`` must equal
      :func:`vocab_size` of this config.
    bpe_vocab_size: ``bpe`` only (ignored otherwise): V, the vocabulary size
      (separator + 256 bytes + merges); the model's ``vocab_size``.
    loss_domains: the data mixture of the objective: only targets whose
      domain label is one of these names count in the loss (training and
      the validation ``loss``); the other tokens stay in the input as
      context. Empty (default): every domain. Names: :func:`domain_names`
      (``python_stdlib``: code, comment, docstring, string). Fine-tuning
      uses it to pre-train on some domains and fine-tune on a held-out one
      (docs/finetune.md). Routing statistics and the per-domain validation
      losses still count every token.
  """

  name: str = "python_stdlib"
  data_dir: Optional[str] = None
  seq_len: int = 256
  batch_size: int = 16
  seed: int = 0
  train_split: str = "train"
  eval_split: str = "validation"
  download: bool = False
  text_key: Optional[str] = None
  stdlib_max_files: Optional[int] = None
  stdlib_val_fraction: float = 0.05
  stdlib_include_tests: bool = False
  synthetic_seed: int = 0
  synthetic_train_docs: int = 2000
  synthetic_val_docs: int = 200
  synthetic_min_doc_bytes: int = 256
  synthetic_max_doc_bytes: int = 2048
  tokenizer: str = "bytes"
  bpe_vocab_size: int = 4096
  loss_domains: tuple = ()

  def __post_init__(self, path: str = "data"):
    for f in ("seq_len", "batch_size", "synthetic_train_docs", "synthetic_val_docs",
              "synthetic_min_doc_bytes"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{path}.{f}", v, "must be an int > 0", f"set {path}.{f} to a positive int")
    if self.synthetic_max_doc_bytes < self.synthetic_min_doc_bytes:
      raise ConfigError(f"{path}.synthetic_max_doc_bytes", self.synthetic_max_doc_bytes,
                        f"is below synthetic_min_doc_bytes={self.synthetic_min_doc_bytes}",
                        "make the range non-empty")
    if self.stdlib_max_files is not None and self.stdlib_max_files <= 0:
      raise ConfigError(f"{path}.stdlib_max_files", self.stdlib_max_files, "must be > 0 or None",
                        "use None for every file")
    if not 0.0 < self.stdlib_val_fraction < 1.0:
      raise ConfigError(f"{path}.stdlib_val_fraction", self.stdlib_val_fraction,
                        "must lie strictly between 0 and 1", "use e.g. 0.05")
    for f in ("seed", "synthetic_seed"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"{path}.{f}", v, "must be an int >= 0", f"set {path}.{f} >= 0")
    if self.data_dir is not None and (not isinstance(self.data_dir, str)
                                      or not self.data_dir.strip()):
      # "" would resolve to the working directory: datasets prepared wherever the run starts.
      raise ConfigError(f"{path}.data_dir", self.data_dir, "is not a directory name",
                        "give a directory, or leave it unset for the TFDS default "
                        "($TFDS_DATA_DIR or ~/tensorflow_datasets)")
    self._check_builtin_splits(path)
    if self.train_split == self.eval_split:
      raise ConfigError(f"{path}.eval_split", self.eval_split, "equals train_split",
                        "evaluate on a held-out split, e.g. 'validation' or 'test'")
    check_choice(f"{path}.tokenizer", self.tokenizer, TOKENIZERS)
    v = self.bpe_vocab_size
    if (not isinstance(v, int) or isinstance(v, bool)
        or not BPE_MIN_VOCAB_SIZE <= v <= BPE_MAX_VOCAB_SIZE):
      raise ConfigError(f"{path}.bpe_vocab_size", v,
                        f"must be an int in [{BPE_MIN_VOCAB_SIZE}, {BPE_MAX_VOCAB_SIZE}] (the "
                        f"separator and 256 bytes, plus merges; ids are uint16)",
                        "use a few thousand, e.g. 4096")
    self._check_name(path)
    self._check_loss_domains(path)

  def _check_loss_domains(self, path: str) -> None:
    if isinstance(self.loss_domains, list):  # JSON and ml_collections give lists
      object.__setattr__(self, "loss_domains", tuple(self.loss_domains))
    names = domain_names(self.name)
    field = f"{path}.loss_domains"
    if not isinstance(self.loss_domains, tuple):
      raise ConfigError(field, self.loss_domains, "must be a tuple of domain names",
                        f"use e.g. ('{names[0]}',), or () for every domain")
    for d in self.loss_domains:
      if d not in names:
        raise ConfigError(field, self.loss_domains, f"{d!r} is not a domain of {self.name}",
                          f"use names among {', '.join(names)}")
    if len(set(self.loss_domains)) != len(self.loss_domains):
      raise ConfigError(field, self.loss_domains, "names a domain twice", "list each once")

  def _check_builtin_splits(self, path: str) -> None:
    """A built-in dataset's splits are known without reading it: a wrong one fails here, as
    the field, not when the run loads it."""
    if self.name not in BUILTIN_NAMES:
      return  # a TFDS dataset's splits are read from its prepared files (moejax.data.datasets)
    for field, usual in (("train_split", "train"), ("eval_split", "validation")):
      split = getattr(self, field)
      if split not in BUILTIN_SPLITS:
        raise ConfigError(f"{path}.{field}", split,
                          f"{self.name} has no split {split!r} (its splits: "
                          f"{', '.join(BUILTIN_SPLITS)})", f"set {path}.{field}={usual!r}")

  def _check_name(self, path: str) -> None:
    if self.name in BUILTIN_NAMES:
      return
    if not isinstance(self.name, str) or not _TFDS_NAME.match(self.name):
      raise ConfigError(f"{path}.name", self.name, "is not a dataset name",
                        f"use {' or '.join(BUILTIN_NAMES)}, or a TFDS name like 'tiny_shakespeare'")
    # Imported here: a config of a built-in dataset should not pay for TFDS.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    base = self.name.split(":")[0].split("/")[0]
    registry = tfds.list_builders(with_community_datasets=False)
    data_dir = os.path.expanduser(self.data_dir or os.environ.get("TFDS_DATA_DIR",
                                                                  "~/tensorflow_datasets"))
    if base in registry or os.path.isdir(os.path.join(data_dir, base)):
      return
    raise ConfigError(f"{path}.name", self.name,
                      *names.unknown_dataset(base, data_dir, BUILTIN_NAMES, registry))

  def builder_config(self):
    """The TFDS builder config that this DataConfig selects (built-ins only)."""
    if self.name == "python_stdlib":
      from moejax.data import stdlib  # pylint: disable=g-import-not-at-top
      name = stdlib.default_config_name()
      if self.stdlib_max_files is not None:
        name += f"-first{self.stdlib_max_files}"
      if self.stdlib_val_fraction != stdlib.DEFAULT_VAL_FRACTION:
        name += f"-val{self.stdlib_val_fraction:g}"
      if self.stdlib_include_tests:
        name += "-tests"
      return stdlib.StdlibConfig(name=name, max_files=self.stdlib_max_files,
                                 val_fraction=self.stdlib_val_fraction,
                                 include_tests=self.stdlib_include_tests)
    if self.name == "synthetic_domains":
      from moejax.data import synthetic  # pylint: disable=g-import-not-at-top
      return synthetic.config_for(self.synthetic_seed, self.synthetic_train_docs,
                                  self.synthetic_val_docs, self.synthetic_min_doc_bytes,
                                  self.synthetic_max_doc_bytes)
    return None


def domain_names(name: str) -> tuple[str, ...]:
  """The domain labels of dataset ``name`` (what ``Documents.domain_names`` will hold)."""
  return DOMAINS.get(name, TEXT_DOMAINS)


def vocab_size(cfg: DataConfig) -> int:
  """V, the number of token ids the data of ``cfg`` uses: the model's ``vocab_size``.

  Known from the config alone (nothing is trained or read): 256 for
  ``bytes``; ``bpe_vocab_size`` for ``bpe`` (a tokenizer trained on a corpus
  too small to fill it leaves the top ids unused).
  """
  return cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else BYTE_VOCAB_SIZE


def check_vocab_size(model_vocab_size: int, cfg: DataConfig) -> None:
  """ConfigError on ``model.vocab_size`` unless it equals :func:`vocab_size` of ``cfg``."""
  want = vocab_size(cfg)
  if model_vocab_size == want:
    return
  given = (f"data.tokenizer='bpe' with bpe_vocab_size={cfg.bpe_vocab_size}"
           if cfg.tokenizer == "bpe" else f"data.tokenizer={cfg.tokenizer!r}")
  raise ConfigError("model.vocab_size", model_vocab_size,
                    f"the data has {want} token ids ({given})",
                    f"set model.vocab_size={want} for {given}")
