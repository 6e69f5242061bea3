"""The scale ladder: hand-checked sizes, s is today's suites, budgets and arm relations kept."""

from __future__ import annotations

import dataclasses
import io
import os
import typing

import pytest

from moejax.ablation import bases, runner, scale as scale_lib, suite as suite_lib
from moejax.ablation.budget import arm_budget, spread
from moejax.config import ConfigError, to_dict, unwrap_optional
from moejax.config.registry import ATTENTIONS, LAYERS
from moejax.train.config import ExperimentConfig, experiment_from_dict
from tests.ablation import helpers


def _suite(name: str, scale: str | None = None):
  tree = suite_lib.load_suite_file(os.path.join(helpers.ROOT, "configs", "ablations",
                                                f"{name}.py"))
  if scale is not None:
    tree["scale"] = scale
  return suite_lib.suite_from_dict(tree)


# d, layers, expert width, dense width, seq, batch, steps of the small suite model per rung.
SMALL = {"s": (64, 2, 128, 256, 64, 16, 300), "m": (128, 4, 256, 512, 128, 16, 300),
         "l": (192, 4, 384, 768, 128, 32, 300)}


@pytest.mark.parametrize("rung", sorted(SMALL))
def test_small_model_sizes_by_hand(rung):
  exp = _suite("lossfree", rung).arm("aux_1e-2").experiment
  d, n_layers, f, dense, seq, batch, steps = SMALL[rung]
  m, t = exp.model, exp.model.moe.topology
  assert (m.d_model, m.n_layers, t.expert_width, m.dense_ff_width) == (d, n_layers, f, dense)
  assert (exp.data.seq_len, exp.data.batch_size, exp.train.steps) == (seq, batch, steps)
  assert (t.num_experts, exp.model.moe.routing.top_k, m.n_heads) == (8, 2, 4)  # counts stay
  # Per layer: attention 4 d^2, two RMSNorm scales, router d E, 8 SwiGLU experts 3 d f;
  # embedding and LM head V d each, final norm d. Active: 2 of the 8 experts, no embedding.
  v, e = 256, 8
  total = n_layers * (4 * d * d + 2 * d + d * e + e * 3 * d * f) + 2 * v * d + d
  active = n_layers * (4 * d * d + 2 * d + d * e + 2 * 3 * d * f) + v * d + d
  b = arm_budget(exp)
  assert b.total == total and b.active == active
  assert b.tokens == steps * batch * seq
  assert {"s": 460_096, "m": 3_478_656, "l": 7_773_888}[rung] == total


def test_ladder_compute_ratios():
  """m is ~15x the training compute of s (7.6x the parameters, 2x the tokens); l ~4x m."""
  b = {r: arm_budget(_suite("lossfree", r).arm("aux_1e-2").experiment) for r in SMALL}
  assert 12 < b["m"].train_flops / b["s"].train_flops < 18
  assert 3.5 < b["l"].train_flops / b["m"].train_flops < 5
  assert b["m"].tokens == 2 * b["s"].tokens and b["l"].tokens == 2 * b["m"].tokens


@pytest.mark.parametrize("name", helpers.SUITES)
def test_s_is_todays_suite_exactly(name):
  """scale=s (the default) builds every arm exactly as the suite file's base + overrides."""
  tree = suite_lib.load_suite_file(os.path.join(helpers.ROOT, "configs", "ablations",
                                                f"{name}.py")).to_dict()
  assert tree["scale"] == "s"
  base = to_dict(experiment_from_dict(tree["base"]))
  suite = _suite(name)
  for arm in suite.arms:
    want = suite_lib.merge(base, tree["arms"][arm.name])
    if arm.name in suite.match_compute:  # steps derived from the reference arm's compute
      assert arm.experiment.train.steps != want["train"]["steps"]
      want["train"]["steps"] = arm.experiment.train.steps
    assert arm.experiment == experiment_from_dict(want)


def test_small_experiment_is_todays_but_for_the_eval_cadence():
  """The small suite model, field by field (the eval cadence: 15 points on 4 batches)."""
  exp = bases.small_experiment()
  assert exp["model"] == dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                              dense_ff_width=256, moe=bases.SMALL_MOE)
  assert exp["data"] == dict(name="python_stdlib", seq_len=64, batch_size=16, seed=0)
  assert exp["train"] == dict(steps=300, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                              weight_decay=0.1, grad_clip=1.0, log_every=25, eval_every=20,
                              eval_batches=4, checkpoint_every=100, keep_checkpoints=4,
                              progress=True)


@pytest.mark.parametrize("rung", sorted(scale_lib.SCALES))
@pytest.mark.parametrize("name", helpers.SUITES)
def test_every_shipped_suite_passes_its_budget_check_at_every_rung(name, rung):
  suite = _suite(name, rung)
  out = io.StringIO()
  runner.check_suite(suite, out)
  assert f"at scale {rung} ({scale_lib.SCALES[rung].describe()})" in out.getvalue()
  s = _suite(name, "s")
  for arm, small in zip(suite.arms, s.arms):  # every arm got the same transformation
    w = scale_lib.SCALES[rung].width
    assert arm.experiment.model.d_model == w * small.experiment.model.d_model
    if small.experiment.model.moe is not None:
      assert arm.experiment.model.moe.widths == tuple(
          w * x for x in small.experiment.model.moe.widths)
      assert (arm.experiment.model.moe.topology.num_experts
              == small.experiment.model.moe.topology.num_experts)


def test_fine_grained_arms_stay_fine_grained_relative_to_the_scaled_coarse_layer():
  for rung, w in (("s", 1), ("m", 2), ("l", 3)):
    suite = _suite("granularity", rung)
    coarse = suite.arm("coarse").experiment.model.moe
    assert (coarse.topology.num_experts, coarse.topology.expert_width) == (8, 128 * w)
    for m in (2, 4, 8):
      fine = suite.arm(f"fine_m{m}").experiment.model.moe
      assert fine.topology.num_experts == 8 * m and fine.routing.top_k == 2 * m
      assert fine.topology.expert_width == 128 * w // m
    dsm = _suite("deepseekmoe", rung).arm("deepseekmoe").experiment.model.moe
    assert (dsm.topology.num_experts, dsm.routing.top_k) == (31, 7)
    assert dsm.topology.num_shared_experts == 1
    assert dsm.topology.expert_width == dsm.topology.shared_expert_width == 128 * w // 4


@pytest.mark.parametrize("name", ["granularity", "deepseekmoe"])
def test_router_driven_budget_differences_shrink_with_scale(name):
  """Routers grow as d E, experts as d f: the equal-budget arms get closer at larger rungs."""
  spreads = []
  for rung in ("s", "m", "l"):
    b = [arm_budget(a.experiment) for a in _suite(name, rung).arms]
    spreads.append(spread([x.active for x in b]))
  assert spreads[0] > spreads[1] > spreads[2] > 0


def test_steps_factor_scales_every_position_in_the_run():
  tree = to_dict(experiment_from_dict(bases.small_experiment()))
  tree["model"]["moe"]["balance"]["bias_freeze_step"] = 150
  out = scale_lib.scale_experiment(tree, scale_lib.Scale("t", steps=2, batch=2))
  t = out["train"]
  assert (t["steps"], t["warmup_steps"], t["log_every"], t["eval_every"],
          t["checkpoint_every"]) == (600, 40, 50, 40, 200)
  assert out["model"]["moe"]["balance"]["bias_freeze_step"] == 300
  assert (t["eval_batches"], t["keep_checkpoints"], t["seed"]) == (4, 4, 0)
  assert out["data"]["batch_size"] == 32 and out["data"]["seq_len"] == 64
  tree["train"]["eval_every"] = 0  # 0 = off and -1 = never stay what they are
  tree["model"]["moe"]["balance"]["bias_freeze_step"] = -1
  out = scale_lib.scale_experiment(tree, scale_lib.Scale("t", steps=3))
  assert out["train"]["eval_every"] == 0
  assert out["model"]["moe"]["balance"]["bias_freeze_step"] == -1
  assert scale_lib.scale_experiment(tree, "s") == tree


def test_dense_model_and_per_expert_widths_scale():
  tree = to_dict(experiment_from_dict(bases.small_experiment()))
  tree["model"]["moe"]["topology"]["expert_widths"] = (64, 128, 64, 128, 64, 128, 64, 128)
  out = scale_lib.scale_experiment(tree, "m")
  assert out["model"]["moe"]["topology"]["expert_widths"] == (128, 256) * 4
  tree["model"]["moe"] = None
  out = scale_lib.scale_experiment(tree, "m")
  assert out["model"]["moe"] is None and out["model"]["dense_ff_width"] == 512
  experiment_from_dict(out)


def _int_fields(cls, prefix: str) -> list[str]:
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    tp = unwrap_optional(hints[f.name])
    path = f"{prefix}.{f.name}" if prefix else f.name
    if dataclasses.is_dataclass(tp):
      out += _int_fields(tp, path)
    elif tp is int or f.name == "expert_widths":
      out.append(path)
  return out


def test_every_integer_field_is_scaled_or_deliberately_not():
  """A new width or step field must be added to scale.FIELDS (or to UNSCALED, with a reason)."""
  scaled = {p for paths in scale_lib.FIELDS.values() for p in paths}
  fields = {p for p in _int_fields(ExperimentConfig, "") if not p.startswith("parallel.")}
  # The shipped layer kinds' own options (model.moe.layer_options, typed by the kind).
  for name in LAYERS.names():
    kind = LAYERS.get(name)
    if type(kind).__module__.startswith("moejax."):
      fields |= set(_int_fields(kind.Options, "model.moe.layer_options"))
  for name in ATTENTIONS.names():  # and the attention kinds' (model.attention_options)
    kind = ATTENTIONS.get(name)
    if type(kind).__module__.startswith("moejax.") and dataclasses.is_dataclass(kind.Options):
      fields |= set(_int_fields(kind.Options, "model.attention_options"))
  assert not scaled & set(scale_lib.UNSCALED)
  assert fields - scaled - set(scale_lib.UNSCALED) == set()
  assert (scaled | set(scale_lib.UNSCALED)) - fields == set()  # no stale path either


def test_bad_scale_names_the_field():
  with pytest.raises(ConfigError, match=r"suite\.scale.*'xl'.*not a rung.*s, m, l"):
    suite_lib.suite_from_dict(helpers.tiny_suite(scale="xl"))
  with pytest.raises(ConfigError, match=r"suite\.arms\.aux.*at suite\.scale=m"):
    # the rung is named with an invalid arm (3 heads do not divide d = 64)
    suite_lib.suite_from_dict(helpers.tiny_suite(
        scale="m", arms={"aux": dict(model=dict(n_heads=3)), "bias": {}}))


def test_scale_is_a_command_line_field_and_recorded():
  tree = suite_lib.load_suite_file(os.path.join(helpers.ROOT, "configs", "ablations",
                                                "quick.py"))
  tree.scale = "m"  # what --config.scale=m does
  suite = suite_lib.suite_from_dict(tree)
  assert suite.scale == "m" and suite.arms[0].experiment.model.d_model == 256
  assert suite_lib.base_experiment(tree).model.d_model == 256


def test_ladder_table_lists_every_rung_of_the_baseline_arm():
  tree = suite_lib.load_suite_file(os.path.join(helpers.ROOT, "configs", "ablations",
                                                "lossfree.py"))
  lines = runner.ladder_table(tree).splitlines()
  assert len(lines) == 2 + len(scale_lib.SCALES)
  assert lines[2].startswith("| s | identity | 64 | 2 | 64 x 16 x 300 | 460.10K |")
  assert lines[3].startswith("| m | width x2, depth x2, seq x2 | 128 | 4 | 128 x 16 x 300 |")
  assert lines[2].endswith("| 1.0 |") and lines[3].endswith("| 14.8 |")


def test_mla_widths_grow_with_the_model_and_peer_keeps_its_singleton_experts():
  """MLA's latent ranks and head widths scale like an MHA head (w-fold, heads kept); a PEER
  layer's expert width, which PEER does not read, is not set by the ladder (it would be
  refused), while its query width scales."""
  mla = bases.small_experiment()
  mla["model"].update(attention="mla", attention_options=dict(
      q_lora_rank=0, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=4,
      v_head_dim=16))
  m = experiment_from_dict(scale_lib.scale_experiment(to_dict(experiment_from_dict(mla)), "m"))
  assert m.model.d_model == 128 and m.model.n_heads == 4
  o = m.model.attention_options
  assert (o.q_lora_rank, o.kv_lora_rank, o.qk_nope_head_dim, o.qk_rope_head_dim,
          o.v_head_dim) == (0, 48, 32, 8, 32)
  peer = bases.small_experiment(dict(kind="peer", layer_options=dict(
      num_keys=16, heads=2, top_k=4, key_dim=16)))
  tree = to_dict(experiment_from_dict(peer))
  m = experiment_from_dict(scale_lib.scale_experiment(tree, "m"))
  assert m.model.moe.topology.expert_width == tree["model"]["moe"]["topology"]["expert_width"]
  assert m.model.moe.layer_options.key_dim == 32
