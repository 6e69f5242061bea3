"""A split a dataset does not have is one line naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from moejax import data
from moejax.config import ConfigError
from moejax.data import config as data_config
from tests.data.test_datasets import prepare_shakespeare


@pytest.mark.parametrize("name", data_config.BUILTIN_NAMES)
def test_a_built_in_datasets_missing_split_is_refused_as_the_field(name):
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name=name, eval_split="test")
  assert str(err.value) == (f"data.eval_split='test': {name} has no split 'test' (its splits: "
                            "train, validation). Fix: set data.eval_split='validation'")
  with pytest.raises(ConfigError) as err:
    data.DataConfig(name=name, train_split="training")
  assert str(err.value) == (f"data.train_split='training': {name} has no split 'training' (its "
                            "splits: train, validation). Fix: set data.train_split='train'")


def test_the_built_in_builders_make_exactly_those_splits(tmp_path):
  for cfg in (data.DataConfig(name="synthetic_domains", synthetic_train_docs=3,
                              synthetic_val_docs=2),
              data.DataConfig(name="python_stdlib", stdlib_max_files=12,
                              stdlib_val_fraction=0.3)):
    builder = data.builtin_builder(cfg.name, str(tmp_path), cfg.builder_config())
    assert tuple(sorted(builder.info.splits)) == data_config.BUILTIN_SPLITS


def test_a_tfds_datasets_missing_split_names_the_fields(tmp_path):
  prepare_shakespeare(str(tmp_path), "array_record")
  with pytest.raises(data.DatasetUnavailableError) as err:
    data.get_dataset("tiny_shakespeare", "dev", str(tmp_path))
  assert str(err.value) == ("tiny_shakespeare has no split 'dev'; available: train, validation, "
                            "test. Fix: set data.train_split / data.eval_split to one of "
                            "those")
