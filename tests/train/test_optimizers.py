"""Optimizers as registered ideas: Muon per expert, the partition the model declares, config."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, from_dict
from moejax.config.finetune import FinetuneConfig
from moejax.config.registry import OPTIMIZERS
from moejax.model import Transformer, param_role_tree
from moejax.nn import adapters as adapters_lib
from moejax.topology import roles
from moejax.train import checkpoint as ckpt_lib
from moejax.train import loop, metrics_log, optimizers
from moejax.train import step as step_lib
from moejax.train.config import (TrainConfig, experiment_config_dict, experiment_from_dict,
                                 experiment_to_json)
from moejax.train.optim import make_optimizer, role_lookup
from tests.train import helpers

E, D, F = 3, 4, 6
LR = 0.1


def _muon_cfg(**kw) -> TrainConfig:
  """A constant learning rate (no warmup, no decay), no weight decay, no clipping."""
  base = dict(steps=10, warmup_steps=0, learning_rate=LR, min_lr_ratio=1.0, weight_decay=0.0,
              grad_clip=0.0, optimizer="muon")
  return TrainConfig(**{**base, **kw})


_TOY_ROLES = {("experts",): roles.stack("experts"), ("router",): roles.elementwise("router"),
              ("scale",): roles.elementwise("norm")}


def _toy(grads_experts):
  params = {"experts": jnp.ones((E, D, F)), "router": jnp.ones((D, E)), "scale": jnp.ones(D)}
  grads = {"experts": grads_experts, "router": jnp.full((D, E), 0.5), "scale": jnp.full(D, -2.0)}
  return params, grads


def _one_update(tx, params, grads):
  """The first update (jitted: op by op, Newton-Schulz dispatches hundreds of small ops)."""
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def _optax_muon_alone(g: jax.Array) -> np.ndarray:
  """optax's own Muon on one 2-D matrix, with the options MuonOptions defaults to."""
  tx = optax.contrib.muon(LR, ns_steps=5, beta=0.95, nesterov=True, consistent_rms=0.2)
  return np.asarray(_one_update(tx, {"w": jnp.ones(g.shape)}, {"w": g})["w"])


def test_muon_update_of_each_expert_is_muon_of_that_expert_alone():
  g = jax.random.normal(jax.random.key(0), (E, D, F))
  tx = _muon_cfg().optimizer_spec.transform(_muon_cfg(), _TOY_ROLES.__getitem__)
  params, grads = _toy(g)
  stacked = np.asarray(_one_update(tx, params, grads)["experts"])
  for e in range(E):
    np.testing.assert_allclose(stacked[e], _optax_muon_alone(g[e]), rtol=1e-4, atol=1e-6)
  # Orthogonalising the stack as one [E d, f] matrix would give another update.
  flat = _optax_muon_alone(g.reshape(E * D, F)).reshape(E, D, F)
  assert np.max(np.abs(flat - stacked)) > 0.1 * np.max(np.abs(stacked))
  # An expert's update reads its own gradient only.
  other = _one_update(tx, params, {**grads, "experts": g.at[1].multiply(-3.0)})["experts"]
  np.testing.assert_array_equal(np.asarray(other[0]), stacked[0])
  np.testing.assert_array_equal(np.asarray(other[2]), stacked[2])
  assert not np.allclose(np.asarray(other[1]), stacked[1])


def test_muon_orthogonalises_gate_and_up_of_a_gate_up_stack_apart():
  """[E, d, 2f] w_gate_up is 2E matrices: its update is the updates of W_gate and W_up
  as separate [E, d, f] stacks, side by side (as when they were stored apart)."""
  g = jax.random.normal(jax.random.key(5), (E, D, 2 * F))
  cfg = _muon_cfg(weight_decay=0.5)
  joint = {("experts",): roles.stack("experts", output_blocks=2)}
  tx = cfg.optimizer_spec.transform(cfg, joint.__getitem__)
  params = {"experts": jax.random.normal(jax.random.key(6), (E, D, 2 * F))}
  got = np.asarray(_one_update(tx, params, {"experts": g})["experts"])
  apart = {("gate",): roles.stack("experts"), ("up",): roles.stack("experts")}
  tx2 = cfg.optimizer_spec.transform(cfg, apart.__getitem__)
  split = lambda a: {"gate": a[..., :F], "up": a[..., F:]}  # noqa: E731
  want = _one_update(tx2, split(params["experts"]), split(g))
  np.testing.assert_allclose(got, np.concatenate([want["gate"], want["up"]], -1), rtol=1e-5,
                             atol=1e-7)
  # Orthogonalising [W_gate | W_up] as one [d, 2f] matrix per expert would give another update.
  one = {("experts",): roles.stack("experts")}
  fused = np.asarray(_one_update(cfg.optimizer_spec.transform(cfg, one.__getitem__), params,
                                 {"experts": g})["experts"])
  assert np.max(np.abs(fused - got)) > 0.05 * np.max(np.abs(got))


def test_muon_scales_each_expert_update_to_adamw_rms():
  """Liu et al. 2502.16982: lr * 0.2 sqrt(max(A, B)) x an orthogonal-ish matrix: the update's
  RMS is about 0.2 lr whatever the shape (NS leaves singular values in ~[0.7, 1.2])."""
  g = jax.random.normal(jax.random.key(1), (E, D, F))
  tx = _muon_cfg().optimizer_spec.transform(_muon_cfg(), _TOY_ROLES.__getitem__)
  stacked = np.asarray(_one_update(tx, *_toy(g))["experts"])
  for e in range(E):
    sv = np.linalg.svd(stacked[e] / (-LR * 0.2 * np.sqrt(max(D, F))), compute_uv=False)
    assert 0.6 < sv.min() and sv.max() < 1.3, sv


def test_muon_leaves_routers_and_vectors_to_the_same_adamw():
  g = jax.random.normal(jax.random.key(2), (E, D, F))
  cfg = _muon_cfg(weight_decay=0.5)
  tx = cfg.optimizer_spec.transform(cfg, _TOY_ROLES.__getitem__)
  params, grads = _toy(g)
  got = _one_update(tx, params, grads)
  rest = {k: v for k, v in params.items() if k != "experts"}
  want = _one_update(optimizers.adamw(cfg), rest, {k: grads[k] for k in rest})
  for k in rest:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def _labels(cfg_model, finetune=None):
  """{path with the block index as '*': 'muon' | 'adamw'} of a model's params."""
  def build():
    m = Transformer(cfg_model, rngs=nnx.Rngs(0))
    if finetune is not None:
      adapters_lib.attach(m, *finetune, jax.random.key(0))
    return m
  model = nnx.eval_shape(build)
  tree = param_role_tree(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {}
  for (path, role), (_, p) in zip(jax.tree_util.tree_leaves_with_path(tree),
                                  jax.tree_util.tree_leaves_with_path(params)):
    keys = ["*" if isinstance(k, int) else str(k) for k in optimizers.path_keys(path)]
    label = "muon" if role.matrix else "adamw"
    assert role.component != "undeclared", "/".join(keys)
    assert p.ndim >= 2 or label == "adamw", "/".join(keys)
    assert out.setdefault("/".join(keys), label) == label
  return out


def test_partition_of_the_default_model():
  model = helpers.experiment("default").model
  assert _labels(model) == {
      "blocks/*/attn/q_proj/kernel": "muon", "blocks/*/attn/k_proj/kernel": "muon",
      "blocks/*/attn/v_proj/kernel": "muon", "blocks/*/attn/o_proj/kernel": "muon",
      "blocks/*/ffn/params/experts/w_gate_up": "muon",
      "blocks/*/ffn/params/experts/w_down": "muon",
      "blocks/*/ffn/params/router/w": "adamw",
      "blocks/*/attn_norm/scale": "adamw", "blocks/*/ffn_norm/scale": "adamw",
      "embed/embedding": "adamw", "lm_head/kernel": "adamw", "final_norm/scale": "adamw",
  }
  role_at = role_lookup(model)
  assert role_at(("blocks", 0, "ffn", "params", "experts", "w_down")) == roles.stack("experts")
  assert role_at(("blocks", 0, "ffn", "params", "experts", "w_gate_up")) == roles.stack(
      "experts", output_blocks=2)
  assert role_at(("blocks", 0, "attn", "q_proj", "kernel")) == roles.matrix("attention")


def test_partition_of_dense_layers_shared_experts_gates_mod_and_lora():
  model = helpers.experiment(
      "tiny", model__first_dense_layers=1, model__moe_layout="first_dense", model__mod_every=2,
      model__moe__topology__num_shared_experts=1, model__moe__topology__shared_expert_gate=True,
      model__moe__topology__constant_experts=1, model__moe__routing__top_k=1).model
  labels = _labels(model, finetune=(("attention", "experts"), 2, 1.0))
  moe = "blocks/*/block/ffn"  # the second block: a MoE block inside a mixture-of-depths block
  want = {
      "blocks/*/ffn/w_gate/kernel": "muon", "blocks/*/ffn/w_down/kernel": "muon",
      f"{moe}/params/experts/w_gate_up": "muon",
      f"{moe}/params/shared/w_up": "muon", f"{moe}/params/shared/w_down": "muon",
      f"{moe}/params/shared/w_shared_gate": "adamw",
      f"{moe}/params/zero_compute/w_c": "adamw", f"{moe}/params/zero_compute/v": "adamw",
      f"{moe}/params/router/w": "adamw",
      f"{moe}/adapters/experts/w_up/a": "adamw", f"{moe}/adapters/experts/w_up/b": "adamw",
      "blocks/*/block/attn/q_proj/lora/lora_a": "adamw",
      "blocks/*/block/attn/q_proj/kernel": "muon",
      "blocks/*/router/kernel": "adamw",  # the mixture-of-depths router
  }
  assert {k: labels.get(k) for k in want} == want


_KINDS = {
    "soft": dict(kind="soft", topology=dict(num_experts=4, expert_width=32, slots_per_expert=2)),
    "peer": dict(kind="peer", topology=dict(peer_num_keys=4, peer_heads=2, peer_top_k=2,
                                            peer_key_dim=8)),
}


@pytest.mark.parametrize("kind, want", [
    ("soft", {"blocks/*/ffn/params/router/phi": "adamw", "blocks/*/ffn/params/router/scale":
              "adamw", "blocks/*/ffn/params/experts/w_gate_up": "muon"}),
    ("peer", {"blocks/*/ffn/params/peer/w_q": "muon", "blocks/*/ffn/params/peer/u": "adamw",
              "blocks/*/ffn/params/peer/v": "adamw",
              "blocks/*/ffn/params/peer/sub_keys": "adamw",
              "blocks/*/ffn/params/peer/q_norm/scale": "adamw"}),
])
def test_partition_of_soft_moe_and_peer(kind, want):
  model = from_dict(ModelConfig, dict(d_model=32, n_layers=1, n_heads=4, moe=_KINDS[kind]))
  labels = _labels(model)
  assert {k: labels.get(k) for k in want} == want


def test_frozen_router_gets_no_muon_or_adamw_update():
  cfg = helpers.experiment("tiny", train__optimizer="muon", model__moe__routing__freeze=True,
                           train__warmup_steps=0)
  tx = make_optimizer(cfg.train, cfg.model)
  _, state = step_lib.abstract_state(cfg, tx)
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), state.params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  updates = _one_update(tx, params, grads)
  # The selection bias is router state: never in what the optimizer sees.
  assert set(state.params["blocks"][0]["ffn"]) == {"params"}
  assert "bias" in state.router_state["blocks"][0]["ffn"]["router_state"]
  ffn = updates["blocks"][0]["ffn"]["params"]
  assert not np.any(np.asarray(ffn["router"]["w"]))
  assert np.all(np.isfinite(np.asarray(ffn["experts"]["w_gate_up"])))
  assert np.any(np.asarray(ffn["experts"]["w_gate_up"]))


@pytest.mark.parametrize("lora", [("attention",), ("attention", "experts")])
def test_muon_under_lora_trains_adapters_with_adamw_and_leaves_base_weights(lora):
  cfg = helpers.experiment("tiny", train__optimizer="muon", train__warmup_steps=0)
  cfg = dataclasses.replace(cfg, finetune=FinetuneConfig(source="/a/run", lora=lora,
                                                         lora_rank=2)).resolved()
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  _, state = step_lib.abstract_state(cfg, tx)
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), state.params)
  updates = _one_update(tx, params, jax.tree.map(lambda p: jnp.full_like(p, 0.3), params))
  block = updates["blocks"][0]
  assert not np.any(np.asarray(block["attn"]["q_proj"]["kernel"]))  # a LoRA target's base
  assert np.all(np.asarray(block["attn"]["q_proj"]["lora"]["lora_a"]) < 0)  # AdamW's step
  experts = np.asarray(block["ffn"]["params"]["experts"]["w_gate_up"])
  assert np.any(experts) != ("experts" in lora)  # Muon's unless adapted


def test_optimizer_and_its_options_are_config_built_checked_and_printed():
  exp = experiment_from_dict({"train": {"optimizer": "muon",
                                        "optimizer_options": {"ns_steps": 3}}})
  train = json.loads(experiment_to_json(exp))["train"]
  assert train["optimizer"] == "muon"
  assert train["optimizer_options"]["ns_steps"] == 3
  assert train["optimizer_options"]["consistent_rms"] == 0.2
  assert TrainConfig().opts == optimizers.AdamWOptions()
  assert set(OPTIMIZERS.names()) >= {"adamw", "muon"}
  # Switching the optimizer leaves the other's defaults in the tree: not an error.
  tree = json.loads(experiment_to_json(exp))
  tree["train"]["optimizer"] = "adamw"
  tree["train"]["optimizer_options"]["ns_steps"] = 5
  assert experiment_from_dict(tree).train.opts == optimizers.AdamWOptions()
  for bad, field in [({"optimizer": "mun"}, "train.optimizer"),
                     ({"optimizer": "muon", "optimizer_options": {"ns_step": 3}},
                      "train.optimizer_options.ns_step"),
                     ({"optimizer": "muon", "optimizer_options": {"momentum": 1.0}},
                      "train.optimizer_options.momentum"),
                     ({"optimizer": "adamw", "optimizer_options": {"momentum": 0.9}},
                      "train.optimizer_options.momentum")]:
    with pytest.raises(ConfigError) as e:
      experiment_from_dict({"train": bad})
    assert e.value.field == field
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="optimizer_options"):
    TrainConfig(optimizer="muon", optimizer_options=optimizers.AdamWOptions())


def test_a_config_file_naming_adamw_takes_muon_options_on_the_command_line():
  tree = experiment_config_dict(train=dict(steps=10, warmup_steps=1))
  assert experiment_from_dict(tree).train.opts == optimizers.AdamWOptions()
  tree.train.optimizer = "muon"
  tree.train.optimizer_options.ns_steps = 3
  tree.train.optimizer_options.learning_rate = 0.02
  assert experiment_from_dict(tree).train.opts == optimizers.MuonOptions(ns_steps=3,
                                                                         learning_rate=0.02)
  # Muon's option without Muon: one line naming the optimizer that reads it.
  tree.train.optimizer = "adamw"
  tree.train.optimizer_options.learning_rate = None
  with pytest.raises(ConfigError, match=r"train.optimizer_options.ns_steps=3: is an option of "
                     r"train.optimizer='muon'.*Fix: remove ns_steps or set "
                     r"train.optimizer='muon'"):
    experiment_from_dict(tree)


def test_adamw_default_is_the_chain_it_always_was():
  """train.optimizer='adamw' builds the update the trainer built before optimizers were ideas:
  clip_by_global_norm, then optax.adamw on the schedule with matrix-only weight decay."""
  cfg = helpers.experiment("tiny", train__warmup_steps=0)
  t = cfg.train
  before = optax.chain(optax.clip_by_global_norm(t.grad_clip), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, t.warmup_steps, t.steps,
                                         t.learning_rate * t.min_lr_ratio),
      b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  tx = make_optimizer(t, cfg.model)
  _, state = step_lib.abstract_state(cfg, tx)
  keys = iter(jax.random.split(jax.random.key(3), 100))
  params = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), state.params)
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params)
  got, want = _one_update(tx, params, grads), _one_update(before, params, grads)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               got, want)


def test_a_run_from_before_the_optimizer_field_resumes_and_a_changed_one_is_refused(
    tiny_copy, data_dir):
  cfg, workdir = tiny_copy
  path = os.path.join(workdir, ckpt_lib.CONFIG_FILE)
  with open(path) as f:
    stored = json.load(f)
  del stored["train"]["optimizer"], stored["train"]["optimizer_options"]
  with open(path, "w") as f:
    json.dump(stored, f)
  plan = ckpt_lib.check_workdir(workdir, cfg)
  assert plan.finished and not plan.changes
  with pytest.raises(ckpt_lib.WorkdirError, match="train.optimizer: stored 'adamw', requested "
                     "'muon'"):
    ckpt_lib.check_workdir(workdir, helpers.experiment("tiny", data_dir, train__optimizer="muon"))


def test_a_muon_run_trains_and_resumes_equal_to_the_uninterrupted_one(tmp_path, data_dir):
  cfg = helpers.experiment("tiny", data_dir, train__optimizer="muon", train__steps=6,
                           train__warmup_steps=1, train__log_every=2, train__checkpoint_every=3,
                           train__keep_checkpoints=3, train__eval_every=0, train__eval_batches=1)
  whole = str(tmp_path / "whole")
  loop.train(cfg, whole, out=io.StringIO())
  resumed = str(tmp_path / "resumed")
  shutil.copytree(whole, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  out = io.StringIO()
  loop.train(cfg, resumed, out=out)
  assert "resumed from checkpoint at step 3" in out.getvalue()
  want = {r["step"]: r for r in metrics_log.read_metrics(whole, "train")}
  got = {r["step"]: r for r in metrics_log.read_metrics(resumed, "train")}
  assert sorted(got) == sorted(want) == [2, 4, 6]
  assert want[6]["loss"] < want[2]["loss"] - 0.5, want  # Muon trains the tiny model
  for step in (4, 6):
    for key in ("loss", "ce", "grad_norm"):
      assert got[step][key] == want[step][key], (step, key)
