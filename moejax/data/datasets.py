"""Datasets by name: the two built-in builders, or any TFDS text dataset.

``get_dataset(name, split, data_dir)`` returns :class:`Documents` for

- ``python_stdlib``: prepared on first use under ``data_dir``, reused after;
- ``synthetic_domains``: likewise;
- any other TFDS name (``tiny_shakespeare``, ``lm1b``, ``wiki40b/en``, ...):
  read from ``data_dir`` when prepared there, in ``array_record`` (through
  ``as_data_source``) or ``tfrecord`` (through our TF-free reader) format.

Nothing here imports TensorFlow. Preparing a registry dataset does need it
(the TFDS builders read their downloads with ``tf.io.gfile``), so when one is
absent we fail at once, before any compute, with the command to prepare it
on a machine that has TensorFlow and a network, and where to put the result.
``download=True`` tries that preparation here (needs ``tensorflow`` and
``importlib_resources`` installed, and a network).

Data dir: ``None`` means the TFDS default (``$TFDS_DATA_DIR`` or
``~/tensorflow_datasets``), where ``tfds build`` puts datasets.

Failures are :class:`DatasetUnavailableError` with one clear message: a data
dir that cannot be created, a prepared file that cannot be read (a truncated
shard: delete the dataset's directory and it is prepared again). When stdout
or stderr is not a terminal, preparing a built-in dataset prints one plain
line instead of TFDS's banner and progress bars (carriage returns and
terminal escape codes in a log file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from typing import Optional

import numpy as np
import tensorflow_datasets as tfds

from moejax.data import documents, names, stdlib, synthetic, tfrecord
from moejax.data.documents import Document, Documents

BUILTIN_DATASETS = {
    "python_stdlib": stdlib.PythonStdlib,
    "synthetic_domains": synthetic.SyntheticDomains,
}
TEXT_DOMAINS = ("text",)


class DatasetUnavailableError(RuntimeError):
  """A dataset is unknown, absent from the data dir, or not readable as text."""


def resolve_data_dir(data_dir: Optional[str]) -> str:
  """``data_dir`` made absolute, or the TFDS default directory when None."""
  if data_dir is None:
    return os.path.expanduser(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))
  return os.path.abspath(os.path.expanduser(data_dir))


def available_datasets() -> list[str]:
  """Built-in names, then the TFDS registry (any text dataset there works)."""
  return list(BUILTIN_DATASETS) + sorted(tfds.list_builders(with_community_datasets=False))


def _base_name(name: str) -> str:
  return name.split(":")[0].split("/")[0]


@contextlib.contextmanager
def _prepare_lock(builder):
  # Several processes of one run (jax.distributed) may start at once; the
  # first prepares, the others wait and then reuse.
  lock_dir = os.path.dirname(os.fspath(builder.data_path))
  os.makedirs(lock_dir, exist_ok=True)
  with open(os.path.join(lock_dir, ".prepare.lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


class _PrivateTempfile:
  """``tempfile`` with ``mkdtemp`` in one directory (see :func:`no_tfds_temporaries`)."""

  def __init__(self, root: str):
    self._root = root

  def mkdtemp(self, suffix=None, prefix=None, dir=None):  # pylint: disable=redefined-builtin
    return tempfile.mkdtemp(suffix, prefix, dir or self._root)

  def __getattr__(self, name):
    return getattr(tempfile, name)


@contextlib.contextmanager
def no_tfds_temporaries():
  """Inside, TFDS's DatasetInfo makes its temporary directories in one deleted after.

  A builder constructed for a dataset not prepared yet calls
  ``DatasetInfo.initialize_from_bucket``, which makes ``tmp*tfds`` in the
  system's temporary directory and, with no online copy of the dataset's
  info (always, offline), returns without deleting it: one empty directory
  per construction.
  """
  from tensorflow_datasets.core import dataset_info  # pylint: disable=g-import-not-at-top
  if getattr(dataset_info, "tempfile", None) is not tempfile:
    yield  # another TFDS layout: nothing to redirect (tests/data/test_tfds_temporaries.py)
    return
  root = tempfile.mkdtemp(prefix="moejax-tfds-")
  dataset_info.tempfile = _PrivateTempfile(root)
  try:
    yield
  finally:
    dataset_info.tempfile = tempfile
    shutil.rmtree(root, ignore_errors=True)


def _interactive() -> bool:
  return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


@contextlib.contextmanager
def _quiet_unless_interactive():
  """No TFDS banner (stdout) or progress bars (stderr) in a non-interactive log."""
  if _interactive():
    yield
    return
  from tensorflow_datasets.core.utils import tqdm_utils  # pylint: disable=g-import-not-at-top
  was = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  finally:
    tfds.display_progress_bar(was)


def _unreadable(name: str, split: str, where: str, docs: Documents) -> Documents:
  """``docs`` whose reads fail as one DatasetUnavailableError naming the damaged data."""
  get = docs.get

  def checked_get(i: int) -> Document:
    try:
      return get(i)
    except Exception as e:  # array_record / tfrecord / zlib: a damaged or truncated file
      raise DatasetUnavailableError(
          f"{name}/{split}: document {i} cannot be read from {where} ({type(e).__name__}: "
          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); the prepared files "
          f"are damaged (a truncated shard?). Fix: delete {where} and run again (built-in "
          "datasets are prepared again; TFDS ones need preparing again)") from e

  return dataclasses.replace(docs, get=checked_get)


def builtin_builder(name: str, data_dir: Optional[str] = None, config=None, prepare: bool = True):
  """The built-in TFDS builder ``name``, prepared under ``data_dir`` if needed.

  Args:
    name: ``python_stdlib`` or ``synthetic_domains`` (a ``/config`` suffix
      selects a registered config).
    data_dir: where prepared datasets live (see module docstring).
    config: a :class:`StdlibConfig` / :class:`SyntheticConfig` instance, or
      None for the default (or the ``/config`` of ``name``).
    prepare: prepare now when the data is not there yet.
  """
  base = _base_name(name)
  if base not in BUILTIN_DATASETS:
    raise DatasetUnavailableError(f"{name!r} is not a built-in dataset; built-ins: "
                                  f"{', '.join(BUILTIN_DATASETS)}")
  if config is None and "/" in name:
    config = name.split("/", 1)[1]
  cls = BUILTIN_DATASETS[base]
  registered = {c.name: c for c in cls.BUILDER_CONFIGS}
  if isinstance(config, tfds.core.BuilderConfig) and config.name in registered:
    # TFDS refuses a custom config named like a registered one; a config that
    # equals the registered one (description aside) is just that one.
    mine, theirs = (dict(vars(c), description=None) for c in (config, registered[config.name]))
    if mine != theirs:
      raise DatasetUnavailableError(f"config {config.name!r} of {base} is registered with other "
                                    f"parameters; give the custom config another name")
    config = config.name
  def make():
    with no_tfds_temporaries():
      return cls(data_dir=resolve_data_dir(data_dir), config=config, file_format="array_record")

  try:
    builder = make()
    if prepare and not builder.is_prepared():
      with _prepare_lock(builder):
        if builder.is_prepared():
          # Another process prepared it while this one waited: this builder
          # read its info before the files existed (no splits), so read again.
          builder = make()
        else:
          with _quiet_unless_interactive():
            builder.download_and_prepare()
          if not _interactive():
            print(f"prepared {name} ({builder.builder_config.name}) in {builder.data_dir}",
                  flush=True)
  except OSError as e:
    raise DatasetUnavailableError(
        f"cannot prepare {name} in data_dir={resolve_data_dir(data_dir)} ({type(e).__name__}: "
        f"{e}). Fix: pass a writable --config.data.data_dir") from e
  return builder


def _documents_from_builtin(builder, name: str, split: str) -> Documents:
  splits = builder.info.splits
  if split not in splits:
    raise DatasetUnavailableError(f"{name} has no split {split!r}; available: "
                                  f"{', '.join(splits)}. Fix: set data.train_split / "
                                  "data.eval_split to one of those")
  metadata = dict(builder.info.metadata or {})
  metadata["config"] = builder.builder_config.name
  docs = documents.from_data_source(builder.as_data_source(split), name, split,
                                    builder.DOMAIN_NAMES, metadata)
  return _unreadable(name, split, os.fspath(builder.data_dir), docs)


def _prepare_instructions(name: str, data_dir: str) -> str:
  return (
      f"To prepare it, on any machine with a network run:\n"
      f"    pip install tensorflow-cpu tensorflow-datasets importlib_resources\n"
      f"    tfds build {name} --data_dir=DIR --file_format=array_record\n"
      f"then copy DIR/{_base_name(name)} to {os.path.join(data_dir, _base_name(name))} on this "
      f"machine (a tfrecord-format copy prepared earlier works too). Or, on a machine with "
      f"TensorFlow and a network, pass download=True (DataConfig.download=True).\n"
      f"Offline, use the built-in corpora instead: {', '.join(BUILTIN_DATASETS)}.")


def _tfds_builder(name: str, data_dir: str):
  try:
    with no_tfds_temporaries():
      return tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    problem, fix = names.unknown_dataset(_base_name(name), data_dir, list(BUILTIN_DATASETS),
                                         tfds.list_builders(with_community_datasets=False),
                                         shown=name)
    raise DatasetUnavailableError(f"{problem}. Fix: {fix}") from e


def _download(builder, name: str, data_dir: str) -> None:
  missing = [m for m in ("tensorflow", "importlib_resources") if importlib.util.find_spec(m) is None]
  if missing:
    raise DatasetUnavailableError(
        f"TFDS dataset {name!r} is not prepared in {data_dir}, and download=True cannot prepare "
        f"it here: preparing TFDS registry datasets needs {' and '.join(missing)} (not installed; "
        f"reading a prepared one does not).\n" + _prepare_instructions(name, data_dir))
  try:
    with _prepare_lock(builder):
      builder.download_and_prepare(file_format="array_record")
  except Exception as e:  # network, checksum, disk: all mean the same to the user
    raise DatasetUnavailableError(
        f"downloading and preparing {name!r} into {data_dir} failed: {type(e).__name__}: {e}\n"
        + _prepare_instructions(name, data_dir)) from e


def _text_key(features, name: str, text_key: Optional[str]) -> str:
  text_keys = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
  if text_key is not None:
    if text_key not in text_keys:
      raise DatasetUnavailableError(f"{name}: text_key={text_key!r} is not a Text feature; "
                                    f"Text features: {text_keys or 'none'}")
    return text_key
  if len(text_keys) != 1:
    raise DatasetUnavailableError(
        f"{name} has {len(text_keys)} Text features ({', '.join(text_keys) or 'none'}); "
        f"{'pass text_key= to pick one' if text_keys else 'it is not a text dataset'}")
  return text_keys[0]


def _documents_from_tfds(name: str, split: str, data_dir: str, download: bool,
                         text_key: Optional[str]) -> Documents:
  builder = _tfds_builder(name, data_dir)
  if not builder.is_prepared():
    if not download:
      raise DatasetUnavailableError(
          f"TFDS dataset {name!r} is not prepared in {data_dir} (looked for "
          f"{builder.data_path}), and this machine cannot download it now (download=False).\n"
          + _prepare_instructions(name, data_dir))
    _download(builder, name, data_dir)
    # Read the prepared info afresh: a builder made before the files existed
    # keeps its empty splits when another process prepared them first.
    builder = _tfds_builder(name, data_dir)
  info = builder.info
  if split not in info.splits:
    raise DatasetUnavailableError(f"{name} has no split {split!r}; available: "
                                  f"{', '.join(info.splits)}. Fix: set data.train_split / "
                                  "data.eval_split to one of those")
  key = _text_key(info.features, name, text_key)
  fmt = info.file_format or tfds.core.FileFormat.TFRECORD
  if fmt == tfds.core.FileFormat.ARRAY_RECORD:
    source, decode = builder.as_data_source(split), lambda ex: ex
  elif fmt == tfds.core.FileFormat.TFRECORD:
    source = tfrecord.TFRecordSource(info.splits[split].filepaths)
    decode = info.features.deserialize_example_np
  else:
    raise DatasetUnavailableError(
        f"{name} is prepared in {fmt.value} format, which moejax reads only through TensorFlow; "
        f"re-prepare it with --file_format=array_record")

  def get(i: int) -> Document:
    text = decode(source[i])[key]
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    tokens = np.frombuffer(data, np.uint8)
    return Document(tokens, np.zeros(tokens.size, np.uint8), f"{split}-{i}")

  metadata = {"file_format": fmt.value, "text_key": key, "version": str(info.version)}
  docs = Documents(name=name, split=split, domain_names=TEXT_DOMAINS, length=len(source),
                   get=get, metadata=metadata)
  return _unreadable(name, split, os.fspath(builder.data_dir), docs)


def get_dataset(name: str, split: str, data_dir: Optional[str] = None, *, config=None,
                download: bool = False, text_key: Optional[str] = None) -> Documents:
  """The documents of ``split`` of dataset ``name`` (see module docstring).

  Args:
    name: a built-in name or a TFDS name (``tiny_shakespeare``, ``lm1b``, ...).
    split: ``train``, ``validation``, or any split the dataset has.
    data_dir: where prepared datasets live; None means the TFDS default.
    config: built-in datasets only, a builder config instance.
    download: TFDS datasets only: try to prepare an absent dataset here.
    text_key: TFDS datasets only: which Text feature, when there are several.

  Raises:
    DatasetUnavailableError: unknown name, absent and not downloadable, no
      such split, or not a text dataset; raised before any data is read.
  """
  data_dir = resolve_data_dir(data_dir)
  if _base_name(name) in BUILTIN_DATASETS:
    return _documents_from_builtin(builtin_builder(name, data_dir, config), name, split)
  if config is not None:
    raise DatasetUnavailableError(f"config= applies to built-in datasets only, not {name!r}; "
                                  f"select a TFDS config in the name, e.g. 'wiki40b/en'")
  return _documents_from_tfds(name, split, data_dir, download, text_key)
