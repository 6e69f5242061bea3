"""Reference arms exempt from a budget quantity, per-arm comparisons (compare_to), suite sources
and the fine-tuning metrics against them."""

from __future__ import annotations

import copy
import io
import json
import os

import numpy as np
import pytest

from moejax.ablation import budget as budget_lib
from moejax.ablation import final_eval, runner, sources, summary as summary_lib, tables
from moejax.ablation import suite as suite_lib
from moejax.config import ConfigError
from moejax.train import metrics_log
from tests.ablation import helpers


def _twins_suite(**changes):
  """The tiny MoE, its dense twin of equal active parameters and its equal-total twin."""
  tree = helpers.tiny_suite(
      arms={"dense": dict(model=dict(dense_twin="active")), "moe": {},
            "dense_total": dict(model=dict(dense_twin="total"))},
      fixed=dict(active=0.05, flops_per_token=0.05, tokens=0.0, optimizer=0.0), seeds=(0,))
  tree.update(changes)
  return tree


def test_a_reference_arm_is_exempt_from_the_quantities_it_cannot_match():
  with pytest.raises(budget_lib.BudgetError, match=r"active: spread .* max dense_total"):
    runner.check_suite(suite_lib.suite_from_dict(_twins_suite()), io.StringIO())
  suite = suite_lib.suite_from_dict(_twins_suite(exempt={"dense_total": ("active",
                                                                         "flops_per_token")}))
  out = io.StringIO()
  runner.check_suite(suite, out)
  text = out.getvalue()
  assert "held equal: active, flops_per_token, tokens, optimizer; not held: total" in text
  assert "active: exempt (reference arm, not held equal): dense_total" in text
  assert "active: spread" in text and "max dense_total" not in text


@pytest.mark.parametrize("changes, match", [
    (dict(exempt={"dense_twice": ("active",)}), r"suite\.exempt\.dense_twice.*not an arm"),
    (dict(exempt={"dense_total": ("activ",)}), r"'activ' is not a budget quantity"),
    (dict(compare_to={"moe": "sparse"}), r"suite\.compare_to\.moe='sparse'"),
    (dict(compare_to={"moe": "moe"}), r"compares an arm with itself"),
    (dict(analysis=dict(speedup_reference="dense_active")),
     r"suite\.analysis\.speedup_reference='dense_active': is not an arm"),
])
def test_bad_reference_fields_are_config_errors(changes, match):
  with pytest.raises(ConfigError, match=match):
    suite_lib.suite_from_dict(_twins_suite(**changes))


def _ft_suite(steps=3, **changes):
  base = helpers.tiny_base(steps)
  base["finetune"] = dict(source=suite_lib.SUITE_SOURCE)
  source = helpers.tiny_base(4)
  source["data"]["loss_domains"] = ("code", "string")
  tree = dict(name="tiny_ft", description="fine-tuning test suite", source=source, base=base,
              arms={"full_new": dict(data=dict(loss_domains=("comment", "docstring"))),
                    "frozen_new": dict(data=dict(loss_domains=("comment", "docstring")),
                                       finetune=dict(freeze=("router",)))},
              fixed=dict(tokens=0.0, optimizer=0.0), seeds=(0,),
              analysis=dict(routing_batches=1, latency=False))
  tree.update(copy.deepcopy(changes))
  return tree


def test_suite_source_is_required_by_and_used_by_the_arms():
  suite = suite_lib.suite_from_dict(_ft_suite())
  assert suite.source is not None and list(suite.source_runs()) == [(0, "source")]
  with pytest.raises(ConfigError, match=r"suite\.source=None: arms \['full_new', 'frozen_new'\] "
                                        r"fine-tune from 'suite:source', but the suite has no"):
    suite_lib.suite_from_dict(_ft_suite(source=None))
  plain = helpers.tiny_suite(source=helpers.tiny_base(4))
  with pytest.raises(ConfigError, match=r"no arm fine-tunes from it"):
    suite_lib.suite_from_dict(plain)
  resolved = sources.resolve(suite, suite.arm("frozen_new").experiment, 0, "/abl")
  assert resolved.finetune.source == "/abl/source" and resolved.model.moe.routing.freeze


def test_finetune_metrics_by_hand():
  # Domains code, comment: the source scored 2.0 / 4.0 nats per token, the fine-tune 2.5 / 3.0.
  names = ("code", "comment")
  ev = final_eval.FinalEval(metrics={"specialisation_mi_norm": 0.30}, doc_ce=np.zeros(1),
                            doc_count=np.zeros(1), joints={}, loads={}, step=3,
                            domain_ce=np.array([25.0, 30.0]), domain_count=np.array([10.0, 10.0]),
                            domain_names=names)
  source = {"domain_names": list(names), "domain_ce": [20.0, 40.0], "domain_count": [10.0, 10.0],
            "loss_domains": ["code"], "specialisation_mi_norm": 0.25}
  exp = suite_lib.suite_from_dict(_ft_suite()).arm("full_new").experiment
  exp = exp.__class__(**{**exp.__dict__, "data": exp.data.__class__(
      **{**exp.data.__dict__, "loss_domains": ("comment",)})})
  got = sources.finetune_metrics(exp, ev, source)
  assert got["forgetting"] == pytest.approx(0.5)      # code: 2.5 - 2.0
  assert got["target_gain"] == pytest.approx(1.0)     # comment: 4.0 - 3.0
  assert got["spec_change"] == pytest.approx(0.05)
  assert sources.domain_loss([20.0, 40.0], [10.0, 10.0], names, ()) == pytest.approx(3.0)


def _summary_with(compare_to):
  def run(arm, seed, loss):
    return {"arm": arm, "seed": seed, "val_loss": loss, "budget": {"total": 10, "trainable": 10}}
  results = [run(a, s, v + 0.1 * s) for a, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))
             for s in (0, 1)]
  return summary_lib.summarise_results(results, baseline="a", order=("a", "b", "c"),
                                       compare_to=compare_to)


def test_compare_to_takes_differences_against_the_named_arm():
  plain = _summary_with({})
  assert plain["comparisons"]["c"]["val_loss"]["diff"]["mean"] == pytest.approx(2.0)
  paired = _summary_with({"c": "b", "b": "-"})
  assert set(paired["comparisons"]) == {"c"}
  entry = paired["comparisons"]["c"]["val_loss"]
  assert entry["baseline"] == "b" and entry["diff"]["mean"] == pytest.approx(1.0)
  paired["compare_to"] = {"c": "b", "b": "-"}
  table = tables.comparison_table(paired)
  assert table.splitlines()[0].startswith("| arm | vs | metric |")
  assert "| c | b | val loss | +1 |" in table
  assert "| arm | metric | Δ vs a |" in tables.comparison_table(plain)


def test_a_source_is_trained_with_what_the_trainer_accepts(tmp_path):
  # The source's pre-training once passed the trainer a bare tuple as the suite ETA, which
  # loop.train could not read: the slow test below caught it only when run.
  seen = []

  class Stop(Exception):
    pass

  def train_fn(exp, path, out, eta, hook, probe=None):
    seen.append((eta, hook))
    raise Stop
  suite = suite_lib.suite_from_dict(_ft_suite())
  with pytest.raises(Stop):
    sources.train_sources(suite, str(tmp_path), train_fn, lambda _: None, io.StringIO(), {})
  (eta, hook), = seen
  assert hook is None and (eta is None or isinstance(eta, metrics_log.SuiteEta))


@pytest.mark.slow
def test_tiny_finetune_suite_trains_its_source_then_the_arms(tmp_path):
  workdir = str(tmp_path / "ft_suite")
  out = io.StringIO()
  results = runner.run_suite(suite_lib.suite_from_dict(_ft_suite()), workdir, out=out)
  text = out.getvalue()
  assert "[source] source: pre-training the suite's source" in text
  with open(os.path.join(workdir, "source", sources.SOURCE_RESULT)) as f:
    src = json.load(f)
  assert src["loss_domains"] == ["code", "string"]
  for rel in ("full_new", "frozen_new"):
    res = results[rel]
    assert {"forgetting", "target_gain", "spec_change"} <= set(res)
    assert res["target_domains"] == ["comment", "docstring"]
    assert res["budget"]["trainable"] <= res["budget"]["total"]
  assert results["frozen_new"]["budget"]["trainable"] < results["full_new"]["budget"]["trainable"]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert "forgetting" in summary["comparisons"]["frozen_new"]
  # A rerun reuses the source and the finished arms.
  again = io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(_ft_suite()), workdir, out=again)
  assert "[source] source: finished earlier, reused" in again.getvalue()
  assert again.getvalue().count("finished earlier, not retrained") == 2
