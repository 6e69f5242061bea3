"""The embedded python_stdlib corpus: file selection, split, prepare-once."""

import os
import platform
import sys

import numpy as np
import pytest

from moejax import data
from moejax.data import stdlib

HANDMADE = {
    "a.py": '"""A doc."""\nx = 1  # one\n',
    "pkg/__init__.py": "",
    "pkg/b.py": "def f():\n    'F doc.'\n    return 'b'\n",
    "pkg/tests/test_b.py": "assert True\n",
    "test/test_a.py": "assert True\n",
    "idlelib/idle_test/t.py": "x = 1\n",
    "site-packages/third.py": "x = 1\n",
    "encodings/cp9.py": "table = 'x'\n",
    "_sysconfigdata__linux.py": "build_time_vars = {}\n",
    "bad.py": "def f(:\n",
    "notes.txt": "not python\n",
}


@pytest.fixture
def handmade_root(tmp_path):
  root = tmp_path / "lib"
  for rel, text in HANDMADE.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  return str(root)


def test_file_selection_excludes_tests_site_packages_generated(handmade_root):
  assert stdlib.list_source_files(handmade_root) == ["a.py", "bad.py", "pkg/__init__.py", "pkg/b.py"]
  with_tests = stdlib.list_source_files(handmade_root, include_tests=True)
  # idlelib/ stays out as a whole (an app, not library code).
  assert with_tests == ["a.py", "bad.py", "pkg/__init__.py", "pkg/b.py",
                        "pkg/tests/test_b.py", "test/test_a.py"]


def test_split_is_deterministic_disjoint_and_by_path_only():
  files = stdlib.list_source_files(stdlib.stdlib_dir())
  assert files == sorted(files) and len(files) > 100
  first = {f: stdlib.split_of(f, 0.05) for f in files}
  assert first == {f: stdlib.split_of(f, 0.05) for f in reversed(files)}
  val = {f for f, s in first.items() if s == "validation"}
  train = {f for f, s in first.items() if s == "train"}
  assert val and train and not val & train and val | train == set(files)
  assert 0.02 < len(val) / len(files) < 0.1
  # Pinned: the split of a path never changes (no Python version, no file list).
  assert stdlib.split_of("chunk.py", 0.05) == "validation"
  assert stdlib.split_of("os.py", 0.05) == "train"
  # A larger fraction only moves files into validation.
  assert val <= {f for f in files if stdlib.split_of(f, 0.2) == "validation"}


def _handmade_config(root, **kw):
  return stdlib.StdlibConfig(name="handmade", root=root, val_fraction=0.5, **kw)


def test_builder_prepares_once_then_reuses(handmade_root, tmp_path, monkeypatch):
  data_dir = str(tmp_path / "tfds")
  calls = []
  original = stdlib.PythonStdlib._split_generators
  monkeypatch.setattr(stdlib.PythonStdlib, "_split_generators",
                      lambda self, dl: calls.append(1) or original(self, dl))
  b1 = data.builtin_builder("python_stdlib", data_dir, _handmade_config(handmade_root))
  info_file = os.path.join(os.fspath(b1.data_path), "dataset_info.json")
  mtime = os.stat(info_file).st_mtime_ns
  docs = data.get_dataset("python_stdlib", "train", data_dir, config=_handmade_config(handmade_root))
  b2 = data.builtin_builder("python_stdlib", data_dir, _handmade_config(handmade_root))
  assert calls == [1]
  assert os.stat(info_file).st_mtime_ns == mtime
  assert b2.is_prepared() and len(docs) == b2.info.splits["train"].num_examples


def test_builder_metadata_docs_and_skipped_file(handmade_root, tmp_path):
  data_dir = str(tmp_path / "tfds")
  cfg = _handmade_config(handmade_root)
  train = data.get_dataset("python_stdlib", "train", data_dir, config=cfg)
  val = data.get_dataset("python_stdlib", "validation", data_dir, config=cfg)
  meta = train.metadata
  assert meta["python_version"] == platform.python_version()
  assert meta["files"] == 4 and len(meta["skipped"]) == 1 and meta["skipped"][0].startswith("bad.py")
  assert len(meta["fingerprint"]) == 64
  names = [d.name for d in train] + [d.name for d in val]
  assert sorted(names) == ["a.py", "pkg/__init__.py", "pkg/b.py"]
  for split, docs in (("train", train), ("validation", val)):
    for d in docs:
      assert stdlib.split_of(d.name, 0.5) == split
      assert bytes(d.tokens) == HANDMADE[d.name].encode()
  by_name = {d.name: d for d in list(train) + list(val)}
  a = by_name["a.py"]
  assert data.label_spans(a.labels) == [(0, 12, data.DOCSTRING), (12, 20, data.CODE),
                                        (20, 25, data.COMMENT), (25, 26, data.CODE)]
  assert train.domain_names == ("code", "comment", "docstring", "string")


def test_real_stdlib_subset_builds_without_tensorflow(tmp_path):
  cfg = data.DataConfig(data_dir=str(tmp_path), stdlib_max_files=6, stdlib_val_fraction=0.5)
  train, val = data.load_documents(cfg, "train"), data.load_documents(cfg, "validation")
  files = stdlib.list_source_files(stdlib.stdlib_dir())[:6]
  assert sorted(d.name for d in list(train) + list(val)) == files
  assert {d.name for d in val} == {f for f in files if stdlib.split_of(f, 0.5) == "validation"}
  assert train.metadata["config"] == f"py{platform.python_version()}-first6-val0.5"
  for d in train:
    with open(os.path.join(stdlib.stdlib_dir(), d.name), "rb") as f:
      assert bytes(d.tokens) == f.read()  # stdlib files are UTF-8 already
    assert d.labels.max() <= data.STRING
  assert "tensorflow" not in sys.modules


@pytest.mark.slow
def test_full_default_corpus(tmp_path):
  cfg = data.DataConfig(data_dir=str(tmp_path))
  train, val = data.load_documents(cfg, "train"), data.load_documents(cfg, "validation")
  assert train.metadata["skipped"] == []
  assert 200 < len(train) and 5 < len(val)
  assert 2_000_000 < train.num_tokens() < 30_000_000
  fractions = np.bincount(np.concatenate([d.labels for d in train]), minlength=4) / train.num_tokens()
  assert (fractions > 0.03).all() and fractions[data.CODE] > 0.4


def test_builder_waiting_on_another_process_reads_its_prepared_splits(
    handmade_root, tmp_path, monkeypatch):
  # Seeds run as separate processes on one empty cache: one prepares, the
  # others wait on the lock and must then see the splits it wrote.
  data_dir = str(tmp_path / "tfds")
  real_lock = data.datasets._prepare_lock

  @data.datasets.contextlib.contextmanager
  def lock_after_other_process_prepared(builder):
    stdlib.PythonStdlib(data_dir=data_dir, config=_handmade_config(handmade_root),
                        file_format="array_record").download_and_prepare()
    with real_lock(builder):
      yield

  monkeypatch.setattr(data.datasets, "_prepare_lock", lock_after_other_process_prepared)
  docs = data.get_dataset("python_stdlib", "train", data_dir,
                          config=_handmade_config(handmade_root))
  prepared = data.builtin_builder("python_stdlib", data_dir, _handmade_config(handmade_root))
  assert len(docs) == prepared.info.splits["train"].num_examples > 0
