"""A fine-tune says which domains its losses cover (moejax.finetune.scope)."""

from __future__ import annotations

import json

from moejax.finetune import scope
from tests.train import helpers


def test_the_loss_scope_names_the_scored_domains_and_the_context():
  cfg = helpers.experiment("tiny", data__loss_domains=("comment", "docstring"))
  assert scope.loss_scope(cfg) == (
      "the loss covers only the comment, docstring targets (data.loss_domains; the code, "
      "string tokens are context, not scored)")
  assert scope.loss_scope(helpers.experiment("tiny")) == (
      "the loss covers every target of python_stdlib (data.loss_domains is empty)")
  every = helpers.experiment("tiny", data__loss_domains=("code", "comment", "docstring",
                                                         "string"))
  assert scope.loss_scope(every) == ("the loss covers only the code, comment, docstring, "
                                     "string targets (data.loss_domains)")


def test_the_summary_gives_every_domain_of_the_last_evaluation(tmp_path):
  rows = [{"split": "train", "step": 4, "loss": 2.0},
          {"split": "eval", "step": 2, "loss": 9.0, "loss_domain/code": 9.0},
          {"split": "eval", "step": 4, "loss": 2.5, "loss_domain/code": 1.25,
           "loss_domain/comment": 2.5, "loss_domain/docstring": 2.75, "loss_domain/string": 3.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = helpers.experiment("tiny", data__loss_domains=("comment", "docstring"))
  assert scope.domain_summary(cfg, str(tmp_path)) == (
      "the train and val loss above cover only the comment, docstring targets "
      "(data.loss_domains; the code, string tokens are context, not scored); the unigram "
      "baseline beside them is over every token; val loss of every domain at step 4: code "
      "1.2500 (not in the loss) | comment 2.5000 | docstring 2.7500 | string 3.0000 (not in "
      "the loss) (metrics.jsonl: loss_domain/<name>)")
  empty = tmp_path / "none"
  empty.mkdir()
  assert scope.last_domain_losses(str(empty)) == (None, {})
  assert scope.domain_summary(helpers.experiment("tiny"), str(empty)) == (
      "the train and val loss above cover every target of python_stdlib (data.loss_domains "
      "is empty)")
