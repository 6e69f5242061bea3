"""The synthetic multi-domain corpus: deterministic, correct, distinguishable."""

import re

import numpy as np

from moejax import data
from moejax.data import synthetic


def docs(seed=0, split="train", n=40, lo=64, hi=256):
  return list(synthetic.generate_split(seed, split, n, lo, hi))


def test_deterministic_in_seed_and_independent_of_count():
  assert docs(seed=3) == docs(seed=3)
  assert docs(seed=3, n=12) == docs(seed=3)[:12]
  assert docs(seed=3) != docs(seed=4)
  assert docs(split="train") != docs(split="validation")


def test_domains_balanced_and_sizes_in_range():
  out = docs(n=40, lo=64, hi=256)
  assert [d for _, _, d in out] == [i % 4 for i in range(40)]
  for _, text, _ in out:
    assert 64 <= len(text) and text.endswith(b"\n") and b"\0" not in text


def test_each_process_is_what_it_claims():
  matrix = synthetic.markov_matrix(0)
  allowed = matrix > 0
  for _, text, domain in docs(n=40):
    lines = text.decode().splitlines()
    for line in lines:
      if domain == 0:
        expr, result = line.split("=")
        assert re.fullmatch(r"\d+([-+*]\d+){1,2}", expr) and int(result) == eval(expr)
      elif domain == 1:
        idx = [b"ABCDEFGHIJKLMNOP".index(c) for c in line.encode()]
        assert len(idx) == 64 and all(allowed[a, b] for a, b in zip(idx, idx[1:]))
      elif domain == 2:
        left, right = line.split("|")
        assert left == right and left.isalpha() and left.islower()
      else:
        assert re.fullmatch(r"[a-z]+( [a-z]+)+\.", line)
  np.testing.assert_allclose(matrix.sum(1), 1.0)
  assert (allowed.sum(1) == 3).all()


def test_domains_distinguishable_from_byte_statistics():
  """Nearest-centroid on byte unigrams, fit on train, scored on validation."""
  def hist(text):
    h = np.bincount(np.frombuffer(text, np.uint8), minlength=256).astype(float)
    return h / h.sum()

  train, val = docs(n=80), docs(split="validation", n=40)
  centroids = np.stack([np.mean([hist(t) for _, t, d in train if d == k], 0) for k in range(4)])
  pred = [int(np.argmin(((centroids - hist(t)) ** 2).sum(1))) for _, t, _ in val]
  assert np.mean(np.array(pred) == np.array([d for _, _, d in val])) == 1.0


def test_builder_labels_every_byte_with_its_domain(tmp_path):
  cfg = data.DataConfig(name="synthetic_domains", data_dir=str(tmp_path), synthetic_seed=5,
                        synthetic_train_docs=12, synthetic_val_docs=4, synthetic_min_doc_bytes=32,
                        synthetic_max_doc_bytes=64)
  train = data.load_documents(cfg, "train")
  assert train.domain_names == ("arithmetic", "markov", "copy", "language")
  expected = docs(seed=5, n=12, lo=32, hi=64)
  assert [(d.name, bytes(d.tokens)) for d in train] == [(k, t) for k, t, _ in expected]
  for d, (_, _, domain) in zip(train, expected):
    assert (d.labels == domain).all()
  assert len(data.load_documents(cfg, "validation")) == 4
