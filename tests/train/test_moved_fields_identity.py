"""A run stored before a field moved is the same experiment today (resume, import, re-check)."""

import json

from moejax.results import recheck
from moejax.train import checkpoint as ckpt_lib
from moejax.train.config import experiment_to_json
from tests.train import helpers

# The PEER / Soft MoE fields as the topology section held them before the layer kinds
# carried their own options.
OLD_TOPOLOGY = {"slots_per_expert": 1, "peer_num_keys": 32, "peer_heads": 4,
                "peer_top_k": 8, "peer_key_dim": 128}


def _old_layout(tree):
  old = json.loads(json.dumps(tree))
  old["model"]["moe"].pop("layer_options", None)
  old["model"]["moe"]["topology"].update(OLD_TOPOLOGY)
  return old


def test_a_config_json_of_the_old_layout_is_the_same_experiment():
  new = json.loads(experiment_to_json(helpers.experiment("tiny")))
  saved = _old_layout(new)
  assert ckpt_lib.identity_changes(ckpt_lib.with_defaults(saved, new), new) == []
  changed = json.loads(json.dumps(saved))
  changed["model"]["moe"]["topology"]["expert_width"] += 1
  assert [c.split(":")[0] for c in ckpt_lib.identity_changes(
      ckpt_lib.with_defaults(changed, new), new)] == ["model.moe.topology.expert_width"]


def test_a_recheck_record_of_the_old_layout_keeps_its_fields_current():
  now = recheck.flat_config(json.loads(experiment_to_json(helpers.experiment("tiny"))))
  recorded = recheck.flat_config(_old_layout(recheck._unflatten(now)))  # pylint: disable=protected-access
  assert "model.moe.topology.peer_heads" in recorded
  assert recheck.config_changes(recorded, now) == []
  recorded["train.learning_rate"] *= 2
  assert recheck.config_changes(recorded, now) == [
      f"train.learning_rate: {recorded['train.learning_rate']!r} -> "
      f"{now['train.learning_rate']!r}"]
