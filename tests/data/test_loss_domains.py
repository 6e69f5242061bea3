"""data.loss_domains: which targets count in the loss; config errors; the domain names."""

import numpy as np
import pytest

from moejax import data
from moejax.config import ConfigError
from moejax.data import Documents, labels, synthetic
from moejax.data import config as data_config


def tiny():
  """Docs 'ab' (domain 1), 'cde' (domain 2), 'f' (domain 3)."""
  return Documents.from_arrays([b"ab", b"cde", b"f"], labels=[[1, 1], [2, 2, 2], [3]],
                               domain_names=("zero", "one", "two", "three"))


def test_loss_labels_mask_other_domains_and_keep_valid():
  # Stream: 0 a b 0 c d e 0 f; the separator takes the label of the document it opens.
  it = data.make_batch_iterator(tiny(), seq_len=3, batch_size=2, train=False,
                                loss_labels=(2,))
  b0, b1 = list(it)
  np.testing.assert_array_equal(b0["labels"], [[1, 1, 2], [2, 2, 2]])
  np.testing.assert_array_equal(b0["mask"], [[False, False, True], [True, True, True]])
  assert b0["valid"].all()
  np.testing.assert_array_equal(b1["valid"], [[True, True, False], [False] * 3])
  assert not b1["mask"].any()          # 'f' and its separator are domain 3
  np.testing.assert_array_equal(b0["target_bytes"], b0["mask"].astype(np.int32))


def test_without_loss_labels_mask_equals_valid():
  for b in data.make_batch_iterator(tiny(), seq_len=3, batch_size=2, train=False):
    np.testing.assert_array_equal(b["mask"], b["valid"])


def test_loss_labels_from_config_names():
  docs = tiny()
  cfg = data.DataConfig(name="python_stdlib")
  assert data.loss_labels(cfg, docs) is None
  # Names are checked against the dataset's domains when the config is built ...
  with pytest.raises(ConfigError, match=r"data\.loss_domains=\('prose',\): 'prose' is not a "
                                        r"domain of python_stdlib.*code, comment"):
    data.DataConfig(loss_domains=("prose",))
  with pytest.raises(ConfigError, match="names a domain twice"):
    data.DataConfig(loss_domains=("code", "code"))
  stdlib_docs = Documents.from_arrays([b"x"], labels=[[0]],
                                      domain_names=labels.PYTHON_DOMAINS)
  assert data.loss_labels(data.DataConfig(loss_domains=("docstring", "comment")),
                          stdlib_docs) == (2, 1)


def test_config_domain_names_match_the_builders():
  assert data_config.DOMAINS["python_stdlib"] == labels.PYTHON_DOMAINS
  assert data_config.DOMAINS["synthetic_domains"] == synthetic.SYNTHETIC_DOMAINS
  assert data.domain_names("tiny_shakespeare") == ("text",)
