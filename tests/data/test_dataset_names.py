"""An unknown dataset name: what works offline first, each name once, the rest needs a download."""

from __future__ import annotations

import os

import pytest
import tensorflow_datasets as tfds

from moejax import data
from moejax.config import ConfigError


def _registry_size() -> int:
  registry = set(tfds.list_builders(with_community_datasets=False))
  return len(registry - {"python_stdlib", "synthetic_domains"})


def _prepare_fake(data_dir, name: str) -> None:
  version = data_dir / name / "1.0.0"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text("{}")


def test_a_near_miss_of_a_built_in_is_suggested_once_and_offline_ones_come_first(tmp_path):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="python_stdlb", data_dir=str(tmp_path))
  assert str(err.value) == (
      f"data.name='python_stdlb': unknown dataset (not built in, not prepared in {tmp_path}, "
      "not in the TFDS registry). Fix: did you mean 'python_stdlib'? available offline: "
      "python_stdlib, synthetic_domains (built in); any other TFDS text dataset (e.g. "
      f"tiny_shakespeare, lm1b; {_registry_size()} in the registry) needs a download first "
      f"(tfds build NAME on a machine with a network, then copy it into {tmp_path})")


def test_prepared_datasets_are_listed_as_offline_and_downloads_are_marked(tmp_path):
  _prepare_fake(tmp_path, "tiny_shakespeare")
  (tmp_path / "downloads" / "x").mkdir(parents=True)   # TFDS's download cache: no dataset
  (tmp_path / "half_done").mkdir()                     # no dataset_info.json: not prepared
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="tiny_shakespear", data_dir=str(tmp_path))
  msg = str(err.value)
  assert ("Fix: did you mean 'tiny_shakespeare'? available offline: python_stdlib, "
          f"synthetic_domains (built in), tiny_shakespeare (prepared in {tmp_path}); any other "
          f"TFDS text dataset (e.g. lm1b; {_registry_size() - 1} in the registry) needs a "
          "download first") in msg
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="lm1c", data_dir=str(tmp_path))
  assert "did you mean 'lm1b' (needs a download)?" in str(err.value)


def test_get_dataset_says_the_same(tmp_path):
  with pytest.raises(data.DatasetUnavailableError) as err:
    data.get_dataset("no_such_set", "train", str(tmp_path))
  msg = str(err.value)
  assert msg.startswith(f"unknown dataset 'no_such_set' (not built in, not prepared in "
                        f"{tmp_path}, not in the TFDS registry). Fix: available offline: "
                        "python_stdlib, synthetic_domains (built in); any other TFDS")
  assert msg.count("python_stdlib") == 1 and os.linesep not in msg


@pytest.mark.parametrize("data_dir", ["", "  "])
def test_an_empty_data_dir_is_refused_not_read_as_the_working_directory(data_dir):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(data_dir=data_dir)
  assert str(err.value) == (f"data.data_dir={data_dir!r}: is not a directory name. Fix: give a "
                            "directory, or leave it unset for the TFDS default ($TFDS_DATA_DIR "
                            "or ~/tensorflow_datasets)")
