"""An unknown dataset name: what works offline first, each name once, the rest needs a download."""

from __future__ import annotations

import os

import pytest

from moejax import data
from moejax.config import ConfigError


def _prepare_fake(data_dir, name: str) -> None:
  version = data_dir / name / "1.0.0"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text("{}")


def test_a_near_miss_of_a_built_in_is_suggested_once_and_offline_ones_come_first(tmp_path):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="python_stdlb", data_dir=str(tmp_path))
  assert str(err.value) == (
      f"data.name='python_stdlb': unknown dataset (not built in, not prepared in {tmp_path}, "
      "not in the TFDS registry). Fix: did you mean 'python_stdlib'? usable offline: "
      "python_stdlib, synthetic_domains (built in); a TFDS text dataset needs preparing into "
      f"{tmp_path} first (tfds build NAME where there is a network)")


def test_prepared_datasets_are_listed_as_offline_and_downloads_are_marked(tmp_path):
  _prepare_fake(tmp_path, "tiny_shakespeare")
  (tmp_path / "downloads" / "x").mkdir(parents=True)   # TFDS's download cache: no dataset
  (tmp_path / "half_done").mkdir()                     # no dataset_info.json: not prepared
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="tiny_shakespear", data_dir=str(tmp_path))
  assert str(err.value).split(". Fix: ")[1] == (
      "did you mean 'tiny_shakespeare'? usable offline: python_stdlib, synthetic_domains "
      f"(built in), tiny_shakespeare (prepared in {tmp_path}); a TFDS text dataset needs "
      f"preparing into {tmp_path} first (tfds build NAME where there is a network)")
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="imdb_review", data_dir=str(tmp_path))
  assert "did you mean 'imdb_reviews' (TFDS: prepare it first)? usable offline" in str(err.value)


def test_a_shared_suffix_suggests_no_registry_names_and_the_line_stays_short(tmp_path):
  # TFDS's registry matched "my_dataset" to math_dataset, bee_dataset, waymo_open_dataset.
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name="my_dataset", data_dir=str(tmp_path))
  assert str(err.value) == (
      f"data.name='my_dataset': unknown dataset (not built in, not prepared in {tmp_path}, "
      "not in the TFDS registry). Fix: usable offline: python_stdlib, synthetic_domains "
      f"(built in); a TFDS text dataset needs preparing into {tmp_path} first (tfds build "
      "NAME where there is a network)")
  assert len(str(err.value)) - 2 * len(str(tmp_path)) < 260


def test_get_dataset_says_the_same(tmp_path):
  with pytest.raises(data.DatasetUnavailableError) as err:
    data.get_dataset("no_such_set", "train", str(tmp_path))
  msg = str(err.value)
  assert msg.startswith(f"unknown dataset 'no_such_set' (not built in, not prepared in "
                        f"{tmp_path}, not in the TFDS registry). Fix: usable offline: "
                        "python_stdlib, synthetic_domains (built in); a TFDS text dataset")
  assert msg.count("python_stdlib") == 1 and os.linesep not in msg


@pytest.mark.parametrize("data_dir", ["", "  "])
def test_an_empty_data_dir_is_refused_not_read_as_the_working_directory(data_dir):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(data_dir=data_dir)
  assert str(err.value) == (f"data.data_dir={data_dir!r}: is not a directory name. Fix: give a "
                            "directory, or leave it unset for the TFDS default ($TFDS_DATA_DIR "
                            "or ~/tensorflow_datasets)")
