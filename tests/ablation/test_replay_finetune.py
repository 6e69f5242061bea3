"""Fine-tuning on replayed routing against the trainer's own (moejax.ablation.replay_finetune).

On configs/tiny.py, fresh weights, 2 steps: a "perturbation" that records the
trainer's own selection makes the two arms agree (flip rate 0, the first
step's loss exactly, the rest to f32 rounding);
one that moves every token to the next expert flips every pair and changes
the replayed arm's loss; bad options are refused in one line naming the
field, before training.
"""

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.ablation import replay_finetune as rf
from moejax.ablation import suite as suite_lib
from moejax.config import ConfigError
from moejax.model import Transformer
from moejax.serve import perturbation as perturbation_lib
from moejax.train.config import experiment_from_dict
from tests.ablation import helpers

DOMAINS = 4   # python_stdlib: code, comment, docstring, string


@pytest.fixture(scope="module")
def tiny():
  exp = experiment_from_dict(helpers.tiny_base())
  model = Transformer(exp.model, rngs=nnx.Rngs(0))
  val = rf.train_batches(exp, 1)   # any batch of the run's data does for the validation pass
  return exp, model, val


def _register(monkeypatch, name, selections):
  monkeypatch.setitem(perturbation_lib.PERTURBATIONS, name,
                      perturbation_lib.Perturbation(name=name, selections=selections))


def test_replaying_the_trainers_own_selection_changes_nothing(tiny, monkeypatch):
  exp, model, val = tiny
  _register(monkeypatch, "same", perturbation_lib.reference_selections)
  got = rf.finetune_pair(exp, model, "same", 2, val, num_domains=DOMAINS)
  assert got["replay_flip_rate"] == 0.0
  own, replayed = got["replay_train_ce_own"], got["replay_train_ce_replay"]
  assert replayed[0] == own[0]   # the same weights: the replayed forward is the forward
  # The replaying step is another compiled program: its update agrees to f32 rounding.
  assert replayed[1] == pytest.approx(own[1], rel=1e-6)
  assert abs(got["replay_loss_gap"]) < 1e-6 and abs(got["replay_val_gap"]) < 1e-5
  assert len(got["replay_train_ce_own"]) == 2 and got["replay_steps"] == 2


def test_a_recording_on_other_experts_flips_every_pair_and_moves_the_loss(tiny, monkeypatch):
  exp, model, val = tiny
  e = exp.model.moe.topology.num_experts

  def unchosen(m, tokens):   # top-2 of 4: each token's two other experts
    own = perturbation_lib.reference_selections(m, tokens)
    out = {}
    for n, s in own.items():
      chosen = np.zeros(s.expert_ids.shape[:-1] + (e,), np.int32)
      np.put_along_axis(chosen, np.asarray(s.expert_ids), 1, axis=-1)
      ids = np.argsort(chosen, axis=-1, kind="stable")[..., :2].astype(np.int32)
      out[n] = dataclasses.replace(s, expert_ids=jnp.asarray(ids))
    return out

  _register(monkeypatch, "unchosen", unchosen)
  got = rf.finetune_pair(exp, model, "unchosen", 2, val, num_domains=DOMAINS)
  assert got["replay_flip_rate"] == 1.0
  ce_own, ce_replay = got["replay_train_ce_own"], got["replay_train_ce_replay"]
  assert ce_replay[0] != ce_own[0]
  assert got["replay_loss_gap"] == pytest.approx(np.mean(ce_replay) - np.mean(ce_own))


def test_the_flip_rate_counts_against_the_training_forwards_selection(monkeypatch):
  tree = helpers.tiny_base()
  tree["model"]["moe"]["routing"].update(kind="sbase", use_bias=False)
  tree["model"]["moe"]["balance"].update(aux_loss_coef=0.0, bias_update="none")
  exp = experiment_from_dict(tree)
  model = Transformer(exp.model, rngs=nnx.Rngs(0))
  _register(monkeypatch, "greedy", perturbation_lib.reference_selections)
  got = rf.finetune_pair(exp, model, "greedy", 1, rf.train_batches(exp, 1), num_domains=DOMAINS)
  # The recording is S-BASE's greedy top-k; the trainer's own step takes the Sinkhorn one.
  batch = rf.train_batches(rf.finetune_config(exp, 1), 1)[0]
  graphdef, params, router_state, other = rf.step_lib.split_model(model)
  greedy = perturbation_lib.reference_selections(model, batch["inputs"])
  start = rf.step_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 router_state=router_state, other=other, opt_state=(),
                                 rng=rf.jax.random.key_data(rf.jax.random.key(exp.train.seed)))
  sinkhorn = rf.train_selections(graphdef)(start, jnp.asarray(batch["inputs"], jnp.int32))
  want = rf.consistency_lib.compare(sinkhorn, greedy, exp.model.moe.num_routed).flip_rate
  assert want > 0.0 and got["replay_flip_rate"] == pytest.approx(want)
  assert got["replay_train_ce_replay"][0] != got["replay_train_ce_own"][0]


@pytest.mark.parametrize("options, match", [
    ({"perturbation": "remat", "steps": 5}, r"replay_finetune\.perturbation='remat'.*own"),
    ({"perturbation": "fp6", "steps": 5}, r"perturbation='fp6'.*use one of.*bf16"),
    ({"perturbation": "bf16", "steps": 0}, r"replay_finetune\.steps=0.*>= 1"),
    ({"perturbation": "bf16"}, r"replay_finetune=.*'perturbation' and 'steps'"),
])
def test_bad_options_are_refused_at_load(options, match):
  tree = helpers.tiny_suite(analysis=dict(replay_finetune=options))
  with pytest.raises(ConfigError, match=match):
    suite_lib.suite_from_dict(tree)


@pytest.mark.slow   # a whole tiny suite (2 arms x 2 seeds); the pieces above run by default
def test_a_suite_reports_the_replay_columns_per_arm(tmp_path):
  from moejax.ablation import runner  # pylint: disable=g-import-not-at-top
  tree = helpers.tiny_suite(analysis=dict(routing_batches=1, latency=False,
                                          replay_finetune={"perturbation": "int4", "steps": 2}))
  results = runner.run_suite(suite_lib.suite_from_dict(tree), str(tmp_path / "s"),
                             out=io.StringIO())
  assert len(results) == 4   # 2 arms x 2 seeds
  for res in results.values():
    assert 0.0 <= res["replay_flip_rate"] <= 1.0 and res["replay_perturbation"] == "int4"
    assert len(res["replay_train_ce_own"]) == len(res["replay_train_ce_replay"]) == 2
  summary = (tmp_path / "s" / "summary.md").read_text()
  assert "replay flip rate" in summary and "replay train gap" in summary
