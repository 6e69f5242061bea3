"""Datasets by name: TFDS text datasets present, absent, unknown; DataConfig."""

import json
import os
import sys
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from tensorflow_datasets.datasets.tiny_shakespeare import tiny_shakespeare_dataset_builder as ts

from moejax import data
from moejax.config import ConfigError, from_dict
from moejax.data import datasets, tfrecord

SPLITS = {"train": "First Citizen:\nSpeak.\n", "validation": "All:\nSpeak, é.\n", "test": "x\n"}


class LocalShakespeare(ts.Builder, skip_registration=True):
  """The real tiny_shakespeare builder, fed local text instead of a download."""

  name = "tiny_shakespeare"
  code_path = None

  @classmethod
  def get_metadata(cls):
    return ts.Builder.get_metadata()

  def _split_generators(self, dl_manager):
    return {s: self._generate_examples(s, text) for s, text in SPLITS.items()}


def prepare_shakespeare(data_dir, file_format):
  """tiny_shakespeare as TFDS prepares it: array_record, or tfrecord as TF would."""
  with datasets.no_tfds_temporaries():  # as moejax's own builders: no tmp*tfds left
    builder = LocalShakespeare(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  if file_format == "tfrecord":
    path = os.fspath(builder.data_path)
    for split in SPLITS:
      src = os.path.join(path, f"tiny_shakespeare-{split}.array_record-00000-of-00001")
      records = array_record_module.ArrayRecordReader(src).read_all()
      os.remove(src)
      with open(os.path.join(path, f"tiny_shakespeare-{split}.tfrecord-00000-of-00001"), "wb") as f:
        f.write(b"".join(tfrecord.encode_record(r) for r in records))
    info_path = os.path.join(path, "dataset_info.json")
    with open(info_path) as f:
      info = json.load(f)
    info["fileFormat"] = "tfrecord"
    with open(info_path, "w") as f:
      json.dump(info, f)


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_prepared_tfds_text_dataset_reads_without_tensorflow(tmp_path, file_format):
  prepare_shakespeare(str(tmp_path), file_format)
  for split, text in SPLITS.items():
    docs = data.get_dataset("tiny_shakespeare", split, str(tmp_path))
    assert len(docs) == 1 and bytes(docs[0].tokens) == text.encode("utf-8")
    assert docs.domain_names == ("text",) and not docs[0].labels.any()
    assert docs.metadata["file_format"] == file_format
  cfg = data.DataConfig(name="tiny_shakespeare", data_dir=str(tmp_path), seq_len=4, batch_size=2)
  batch = next(data.make_batches(cfg, "train"))
  assert batch["inputs"].shape == (2, 4) and batch["inputs"][0, 0] == data.SEPARATOR_ID
  assert "tensorflow" not in sys.modules


def test_missing_tfds_dataset_fails_fast_with_instructions(tmp_path):
  data_dir = str(tmp_path / "empty")
  cfg = data.DataConfig(name="tiny_shakespeare", data_dir=data_dir)  # known name: config is fine
  start = time.perf_counter()
  with pytest.raises(data.DatasetUnavailableError) as err:
    data.make_batches(cfg, "train")
  assert time.perf_counter() - start < 5.0
  msg = str(err.value)
  assert "'tiny_shakespeare' is not prepared in" in msg and data_dir in msg
  assert "tfds build tiny_shakespeare --data_dir=DIR --file_format=array_record" in msg
  assert f"copy DIR/tiny_shakespeare to {os.path.join(data_dir, 'tiny_shakespeare')}" in msg
  assert "python_stdlib" in msg  # the offline alternative
  assert not os.path.exists(os.path.join(data_dir, "tiny_shakespeare", "1.0.0", "dataset_info.json"))


def test_download_without_tensorflow_explains_what_is_missing(tmp_path, monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "tensorflow" else real(name, *a))
  with pytest.raises(data.DatasetUnavailableError, match="needs tensorflow"):
    data.get_dataset("tiny_shakespeare", "train", str(tmp_path), download=True)


def test_unknown_dataset_name_lists_what_is_available(tmp_path):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="tiny_shakespear", data_dir=str(tmp_path))
  msg = str(err.value)
  assert msg.startswith("data.name='tiny_shakespear'")
  assert "did you mean 'tiny_shakespeare'" in msg and "python_stdlib" in msg
  with pytest.raises(data.DatasetUnavailableError, match="unknown dataset 'no_such_set'"):
    data.get_dataset("no_such_set", "train", str(tmp_path))


def test_missing_split_and_non_text_features(tmp_path):
  prepare_shakespeare(str(tmp_path), "array_record")
  with pytest.raises(data.DatasetUnavailableError, match="no split 'dev'; available: train"):
    data.get_dataset("tiny_shakespeare", "dev", str(tmp_path))
  with pytest.raises(data.DatasetUnavailableError, match="text_key='body' is not a Text feature"):
    data.get_dataset("tiny_shakespeare", "train", str(tmp_path), text_key="body")


@pytest.mark.parametrize("field,value,match", [
    ("seq_len", 0, r"data.seq_len=0: must be an int > 0"),
    ("batch_size", -2, r"data.batch_size=-2"),
    ("seed", -1, r"data.seed=-1: must be an int >= 0"),
    ("stdlib_val_fraction", 1.5, r"strictly between 0 and 1"),
    ("eval_split", "train", r"data.eval_split='train': equals train_split"),
    ("synthetic_max_doc_bytes", 10, r"below synthetic_min_doc_bytes"),
    ("name", "bad name!", r"data.name='bad name!': is not a dataset name"),
])
def test_data_config_validation(field, value, match):
  with pytest.raises(ConfigError, match=match):
    data.DataConfig(**{field: value})


def test_data_config_from_dict_rejects_typos():
  assert from_dict(data.DataConfig, {"seq_len": 64}, "data").seq_len == 64
  with pytest.raises(ConfigError, match="did you mean 'seq_len'"):
    from_dict(data.DataConfig, {"seqlen": 64}, "data")


def test_crc32c_known_vector():
  assert tfrecord.crc32c(b"123456789") == 0xE3069283
  frame = tfrecord.encode_record(b"abc")
  assert len(frame) == 8 + 4 + 3 + 4


def test_tfrecord_reader_rejects_foreign_files(tmp_path):
  path = tmp_path / "x.tfrecord"
  path.write_bytes(tfrecord.encode_record(b"one") + tfrecord.encode_record(b"two!"))
  src = tfrecord.TFRecordSource([str(path)])
  assert len(src) == 2 and src[0] == b"one" and src[1] == b"two!"
  bad = tmp_path / "bad.tfrecord"
  bad.write_bytes(b"\x1f\x8b" + bytes(20))  # gzip magic: compressed, not readable
  with pytest.raises(ValueError, match="not an uncompressed TFRecord"):
    tfrecord.TFRecordSource([str(bad)])
