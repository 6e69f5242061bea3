"""Validation: per-document loss sums add up to the split's, and match a direct computation."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import optax
import pytest

from moejax.data import Documents, make_batch_iterator
from moejax.evaluate import validation
from moejax.train import step as step_lib
from moejax.train.config import experiment_from_dict
from moejax.train.optim import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_experiment():
  spec = importlib.util.spec_from_file_location("configs_tiny_for_eval",
                                                os.path.join(ROOT, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return experiment_from_dict(module.get_config().to_dict())


@pytest.fixture(scope="module")
def model_and_docs():
  cfg = _tiny_experiment()
  graphdef, state = step_lib.init_state(cfg, make_optimizer(cfg.train))
  rng = np.random.default_rng(0)
  sizes = (0, 5, 40, 17, 70)  # an empty document, and ones spanning several rows
  docs = Documents.from_arrays([rng.integers(1, 256, n) for n in sizes],
                               labels=[np.arange(n) % 2 for n in sizes], domain_names=("a", "b"))
  return cfg, graphdef, state, docs


def test_per_document_sums_add_up_and_match_a_direct_computation(model_and_docs):
  cfg, graphdef, state, docs = model_and_docs
  seq_len, batch = 16, 3
  batches = lambda: make_batch_iterator(docs, seq_len, batch, train=False)
  step = validation.make_eval_step(graphdef, cfg.model, 2, num_docs=len(docs))
  totals = validation.evaluate_totals(step, state.params, state.router_state, state.other,
                                      batches())
  # Every target counted once: each document's bytes plus the separator opening it
  # (the stream's first separator is never a target).
  np.testing.assert_array_equal(totals["doc_count"], [0, 6, 41, 18, 71])
  assert totals["count"] == 136
  np.testing.assert_allclose(totals["doc_ce"].sum(), totals["ce_sum"], rtol=1e-5)
  # Direct: the model's logits, CE per position, added up by document in numpy.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = nnx.merge(graphdef, state.params, state.router_state, state.other)
  want = np.zeros(len(docs))
  for b in batches():
    logits, _ = model(b["inputs"], train=False)
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        np.asarray(logits, np.float32), b["targets"]))
    np.add.at(want, b["doc_ids"][b["mask"]], ce[b["mask"]])
  np.testing.assert_allclose(totals["doc_ce"], want, rtol=1e-5, atol=1e-5)
  # The summary of the totals is what evaluate() returns (one code path).
  plain = validation.make_eval_step(graphdef, cfg.model, 2)
  got = validation.evaluate(plain, state.params, state.router_state, state.other, batches())
  summary = validation.summarise(totals)
  assert got.keys() == summary.keys()
  for k in got:
    np.testing.assert_allclose(got[k], summary[k], rtol=1e-6)
  assert "doc_ce" not in validation.evaluate_totals(plain, state.params, state.router_state,
                                                    state.other, batches(), num_batches=1)


def test_routing_metrics_by_hand():
  # Layer a: expert 0 takes only domain 0, expert 1 only domain 1, equal mass:
  # I = H(domain) = log 2, MI/H = 1. Layer b: routing ignores the domain: 0.
  joints = {"a": np.array([[2.0, 0.0], [0.0, 2.0]]), "b": np.array([[1.0, 1.0], [3.0, 3.0]])}
  loads = {"a": np.array([2.0, 2.0]), "b": np.array([2.0, 6.0])}
  out = validation.routing_metrics(joints, loads)
  assert out["a/specialisation_mi"] == pytest.approx(np.log(2))
  assert out["a/specialisation_mi_norm"] == pytest.approx(1.0)
  assert out["b/specialisation_mi"] == pytest.approx(0.0, abs=1e-12)
  assert out["specialisation_mi_norm"] == pytest.approx(0.5)
  # MaxVio = max load / mean load - 1: a balanced (0), b 6 / 4 - 1 = 0.5.
  assert out["a/max_vio_global"] == pytest.approx(0.0)
  assert out["b/max_vio_global"] == pytest.approx(0.5)
  assert out["max_vio_global"] == pytest.approx(0.25)
  assert "max_vio_global" not in validation.routing_metrics(joints)
  # Plain lists work too (what routing.json holds for the notebook).
  assert validation.routing_metrics({"x": [[1, 0], [0, 1]]})["specialisation_mi_norm"] == 1.0



def test_per_domain_losses_and_loss_domains(model_and_docs):
  cfg, graphdef, state, docs = model_and_docs
  seq_len, batch = 16, 3
  step = validation.make_eval_step(graphdef, cfg.model, 2)
  run = lambda labels=None: validation.evaluate_totals(
      step, state.params, state.router_state, state.other,
      make_batch_iterator(docs, seq_len, batch, train=False, loss_labels=labels))
  every, only_b = run(), run((1,))
  # Per-domain sums cover every valid target whatever the loss scores, and add up.
  np.testing.assert_array_equal(every["domain_count"], only_b["domain_count"])
  assert every["domain_count"].sum() == every["count"] == 136
  np.testing.assert_allclose(every["domain_ce"].sum(), every["ce_sum"], rtol=1e-5)
  # With loss_labels the loss is domain b's loss; the routing counts stay those of every token.
  assert only_b["count"] == every["domain_count"][1]
  np.testing.assert_allclose(only_b["ce_sum"], every["domain_ce"][1], rtol=1e-5)
  for k in every:
    if k.startswith(("joint/", "load/")):
      np.testing.assert_array_equal(every[k], only_b[k])
  summary = validation.summarise(only_b, ("a", "b"))
  assert summary["loss_domain/b"] == pytest.approx(summary["loss"], rel=1e-6)
  assert summary["loss_domain/a"] == pytest.approx(
      every["domain_ce"][0] / every["domain_count"][0], rel=1e-6)
