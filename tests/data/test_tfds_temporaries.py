"""Preparing a dataset leaves no empty ``tmp*tfds`` directory in the temporary directory.

TFDS's builder makes one each time it is constructed for a dataset that is
not prepared yet (it looks for a copy of the dataset's info online, and
returns without deleting the directory when there is none); a test run left
about thirty.
"""

from __future__ import annotations

import os
import tempfile

from moejax import data
from tests.data.test_datasets import prepare_shakespeare


def _leftovers(tmp: str) -> list[str]:
  return sorted(n for n in os.listdir(tmp) if n.endswith("tfds"))


def test_preparing_a_built_in_dataset_leaves_no_tfds_temporary(tmp_path, monkeypatch):
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  cfg = data.DataConfig(name="synthetic_domains", synthetic_train_docs=3, synthetic_val_docs=2)
  data.builtin_builder(cfg.name, str(tmp_path / "tfds"), cfg.builder_config())
  data.builtin_builder(cfg.name, str(tmp_path / "tfds2"), cfg.builder_config(), prepare=False)
  assert _leftovers(str(tmp)) == []


def test_opening_an_unprepared_tfds_dataset_leaves_no_tfds_temporary(tmp_path, monkeypatch):
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  prepare_shakespeare(str(tmp_path / "tfds"), "array_record")
  try:
    data.get_dataset("tiny_shakespeare", "train", str(tmp_path / "empty"))
  except data.DatasetUnavailableError:
    pass  # not prepared there: the point is what the attempt leaves behind
  assert _leftovers(str(tmp)) == []
