"""The embedded default corpus: the running Python's standard library source.

Legend: L bytes in one document (one file).

Every machine that runs moejax has this corpus, so training works offline
with no download. It is a TFDS builder (``python_stdlib``) written in the
``array_record`` format and read back with ``as_data_source``: neither step
imports TensorFlow.

What goes in (decided once, so that results are comparable):

- every ``.py`` file under ``sysconfig.get_paths()['stdlib']``, listed by
  relative POSIX path in sorted order;
- excluded: test suites (any ``test``/``tests``/``idle_test`` directory;
  they are a third of the stdlib, full of deliberately odd code, and some do
  not even parse), ``site-packages`` (not the stdlib), generated data files
  (``encodings/`` codec tables, ``pydoc_data/``), the machine-specific
  ``_sysconfigdata*`` and ``config-*``, and packages removed in Python 3.12
  or apps rather than library code (``distutils``, ``lib2to3``, ``idlelib``,
  ``turtledemo``, ``ensurepip``), so that the corpus changes little across
  Python versions. On CPython 3.11.7 that leaves 402 files, 8.2 MB (train
  381 files, 7.9 MB; validation 21 files, 0.28 MB), 2.6 MB on disk once
  prepared.
- one document per file: the UTF-8 bytes of its decoded text, with per-byte
  labels code/comment/docstring/string (``moejax/data/labels.py``);
- files that do not decode, tokenize or parse under the running Python are
  skipped (none are, for the files above, on the Python that ships them) and
  listed in the metadata ``skipped``.

Split: by file, ``validation`` when the first 8 bytes of the SHA-256 of the
relative path, as an integer, fall below ``val_fraction * 2**64``; so a file's
split never depends on which other files exist, or on the Python version.

The content differs between Python patch releases, so the config name carries
the full version (``py3.11.7``); the metadata records the version, the stdlib
directory, the file and byte counts and a SHA-256 fingerprint of the selected
files' paths and contents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from typing import Optional

import numpy as np
import tensorflow_datasets as tfds

from moejax.data import documents, labels as labels_lib

PYTHON_VERSION = platform.python_version()
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "distutils",
    "lib2to3", "idlelib", "turtledemo", "ensurepip", "__pycache__",
})
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
DEFAULT_VAL_FRACTION = 0.05


def stdlib_dir() -> str:
  """The running Python's stdlib directory (the base one, also in a venv)."""
  return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str, include_tests: bool = False) -> list[str]:
  """Relative POSIX paths of the corpus's ``.py`` files under ``root``, sorted."""
  excluded = EXCLUDED_DIRS - ({"test", "tests", "idle_test"} if include_tests else set())
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(EXCLUDED_PREFIXES)]
    rel_dir = os.path.relpath(dirpath, root)
    for f in filenames:
      if f.endswith(".py") and not f.startswith(EXCLUDED_PREFIXES):
        found.append(f if rel_dir == "." else f"{rel_dir}/{f}".replace(os.sep, "/"))
  return sorted(found)


def split_of(rel_path: str, val_fraction: float) -> str:
  """``'validation'`` or ``'train'`` by a hash of the path alone."""
  h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
  return "validation" if h < val_fraction * 2**64 else "train"


@dataclasses.dataclass(eq=False)
class StdlibConfig(tfds.core.BuilderConfig):
  """Which files, and how they split.

  Attributes:
    root: the stdlib directory; None means the running Python's. Tests point
      it at a small hand-made tree.
    max_files: keep only the first n files of the sorted list (fast tests).
    val_fraction: expected share of files in ``validation``.
    include_tests: also take the test suites.
  """

  root: Optional[str] = None
  max_files: Optional[int] = None
  val_fraction: float = DEFAULT_VAL_FRACTION
  include_tests: bool = False


def default_config_name() -> str:
  return f"py{PYTHON_VERSION}"


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
  """TFDS builder ``python_stdlib``: the stdlib source, byte-level, labelled."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Byte tokens and code/comment/docstring/string labels per byte."}
  BUILDER_CONFIGS = [StdlibConfig(name=default_config_name(),
                                  description=f"CPython {PYTHON_VERSION} standard library")]
  DOMAIN_NAMES = labels_lib.PYTHON_DOMAINS
  # tfds 4.9.10 resolves `code_path` through `importlib_resources`, which its
  # requirements omit on Python >= 3.9 (ModuleNotFoundError when preparing).
  # The path only locates download checksums, and this builder downloads
  # nothing.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=documents.document_features(),
        metadata=tfds.core.MetadataDict(),
        # Records stay in sorted-path order: the validation pass and the
        # epoch permutations index this order.
        disable_shuffling=True,
    )

  def _root(self) -> str:
    return self.builder_config.root or stdlib_dir()

  def selected_files(self) -> list[str]:
    files = list_source_files(self._root(), self.builder_config.include_tests)
    if self.builder_config.max_files is not None:
      files = files[: self.builder_config.max_files]
    return files

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download: the corpus is on this machine
    cfg, root = self.builder_config, self._root()
    files = self.selected_files()
    if not files:
      raise FileNotFoundError(f"no .py files found under {root!r}; pass StdlibConfig(root=...) "
                              "pointing at a Python standard library")
    examples, skipped, fingerprint = {"train": [], "validation": []}, [], hashlib.sha256()
    for rel in files:
      with open(os.path.join(root, rel), "rb") as f:
        raw = f.read()
      fingerprint.update(rel.encode("utf-8") + b"\0" + hashlib.sha256(raw).digest())
      try:
        data, labels = labels_lib.label_python_source(labels_lib.decode_source(raw))
      except labels_lib.LabelError as e:
        skipped.append(f"{rel}: {e}")
        continue
      examples[split_of(rel, cfg.val_fraction)].append((rel, data, labels))
    self.info.metadata.update({
        "python_version": PYTHON_VERSION,
        "stdlib_dir": root,
        "files": len(files),
        "skipped": skipped,
        "fingerprint": fingerprint.hexdigest(),
        "val_fraction": cfg.val_fraction,
        "domain_names": list(self.DOMAIN_NAMES),
        **{f"{split}_files": len(ex) for split, ex in examples.items()},
        **{f"{split}_bytes": sum(len(d) for _, d, _ in ex) for split, ex in examples.items()},
    })
    return {split: self._generate_examples(ex) for split, ex in examples.items()}

  def _generate_examples(self, examples):
    for rel, data, labels in examples:
      yield rel, {"tokens": np.frombuffer(data, np.uint8), "labels": labels, "name": rel}
