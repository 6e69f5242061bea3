"""LoRA adapters: the documented parameter count, zero-initialised B, expert adapters through
every executor, merging."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import apply_overrides
from moejax.finetune import adapters as adapters_lib
from moejax.config.finetune import present_components
from moejax.model import Transformer
from moejax.nn import lora as lora_lib
from moejax.topology import experts as experts_lib
from tests.train import helpers

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)


def _model_cfg(**overrides):
  return helpers.experiment("tiny", **{f"model__{k}": v for k, v in overrides.items()}).model


CONFIGS = {
    "moe": _model_cfg(),
    "moe_shared_every_other": apply_overrides(
        helpers.experiment("tiny"), {"model.moe.topology.num_shared_experts": 1,
                                     "model.moe_layout": "every_other"}).model,
    "dense_gelu": _model_cfg(moe=None, dense_activation="gelu"),
}


def _params(model):
  _, params, _ = nnx.split(model, nnx.Param, ...)
  return nnx.to_pure_dict(params)


def _count(tree):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("targets", [("attention",), ("dense",), ("experts",),
                                     ("attention", "dense", "experts")])
def test_rank_r_adds_exactly_the_documented_parameters(name, targets):
  cfg, rank = CONFIGS[name], 3
  if not set(targets) <= present_components(cfg):
    pytest.skip(f"{name} has no {targets}")
  before = _count(_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))))

  def adapted():  # shapes only: no weights are computed
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    adapters_lib.attach(model, targets, rank, 1.0, jax.random.key(1))
    return model
  after = _params(nnx.eval_shape(adapted))
  base, adapters = lora_lib.split_tree(after)
  assert _count(base) == before
  want = adapters_lib.lora_param_count(cfg, targets, rank)
  assert _count(after) - before == _count(adapters) == want > 0
  # By hand for the tiny MoE (d=32, 4 heads of 8, 2 kv heads, 4 experts of width 32,
  # 2 layers): q, o: r (32 + 32); k, v: r (32 + 16); SwiGLU experts: 3 E r (32 + 32).
  if name == "moe" and targets == ("attention",):
    assert want == 2 * rank * (2 * 64 + 2 * 48)
  if name == "moe" and targets == ("experts",):
    assert want == 2 * 3 * 4 * rank * 64


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adapters_start_at_zero_and_leave_the_model_unchanged(name):
  cfg = CONFIGS[name]
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  want, _ = model(TOKENS)
  targets = ("attention", "dense") + (("experts",) if cfg.moe is not None else ())
  adapters_lib.attach(model, targets, 4, 2.0, jax.random.key(1))
  _, adapters = lora_lib.split_tree(_params(model))
  for sub in adapters.values():
    for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
      last = str(getattr(path[-1], "key", path[-1]))
      if last in ("b", "lora_b"):
        assert not np.any(np.asarray(leaf))            # B = 0
      else:
        assert np.std(np.asarray(leaf)) > 0             # A random
  got, _ = model(TOKENS)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _perturbed(cfg, targets, backend=None):
  """A model with adapters whose B is random, and the same model with adapters merged."""
  if backend is not None:
    cfg = cfg.__class__(**{**cfg.__dict__, "moe": apply_overrides(
        helpers.experiment("tiny"), {"model.moe.execution.backend": backend}).model.moe})
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  adapters_lib.attach(model, targets, 2, 0.5, jax.random.key(1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  key = iter(jax.random.split(jax.random.key(2), 64))

  def fill(path, leaf):
    last = str(getattr(path[-1], "key", path[-1]))
    return jax.random.normal(next(key), leaf.shape) * 0.3 if last in ("b", "lora_b") else leaf
  pure = jax.tree_util.tree_map_with_path(fill, pure)
  nnx.replace_by_pure_dict(params, pure)
  adapted = nnx.merge(graphdef, params, rest)
  plain = Transformer(cfg, rngs=nnx.Rngs(0))
  g2, p2, r2 = nnx.split(plain, nnx.Param, ...)
  nnx.replace_by_pure_dict(p2, lora_lib.merge_tree(pure, 0.5))
  return adapted, nnx.merge(g2, p2, r2)


@pytest.mark.parametrize("backend", ["reference", "blocked", "ragged_dot"])
def test_expert_adapters_run_through_every_executor_as_merged_weights(backend):
  adapted, merged = _perturbed(CONFIGS["moe"], ("experts", "attention"), backend)
  a, _ = adapted(TOKENS)
  m, _ = merged(TOKENS)
  ref, _ = _perturbed(CONFIGS["moe"], ("experts", "attention"), "reference")[0](TOKENS)
  np.testing.assert_allclose(np.asarray(a), np.asarray(m), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-4, atol=1e-4)
  plain = Transformer(CONFIGS["moe"], rngs=nnx.Rngs(0))
  assert np.abs(np.asarray(a) - np.asarray(plain(TOKENS)[0])).max() > 1e-3  # adapters act


@pytest.mark.slow  # the default run trains expert adapters (tests/finetune/test_train.py)
def test_gradients_reach_the_expert_adapters():
  model = Transformer(CONFIGS["moe"], rngs=nnx.Rngs(0))
  adapters_lib.attach(model, ("experts",), 2, 1.0, jax.random.key(1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    logits, _ = nnx.merge(graphdef, p, rest)(TOKENS)
    return jnp.mean(logits ** 2)
  grads = nnx.to_pure_dict(jax.grad(loss)(params))
  g_b = grads["blocks"][0]["ffn"]["adapters"]["experts"]["w_up"]["b"]
  assert np.abs(np.asarray(g_b)).max() > 0   # B gets a gradient (A does not while B = 0)


def test_merge_tree_drops_adapters_and_folds_them_in():
  tree = {"q": {"kernel": jnp.ones((2, 3)), "lora": {"lora_a": jnp.ones((2, 1)),
                                                     "lora_b": jnp.full((1, 3), 2.0)}},
          "ffn": {"params": {"experts": {"w_up": jnp.zeros((2, 2, 2))}},
                  "adapters": {"experts": {"w_up": {"a": jnp.ones((2, 2, 1)),
                                                    "b": jnp.ones((2, 1, 2))}}}}}
  out = lora_lib.merge_tree(tree, 0.5)
  np.testing.assert_array_equal(out["q"]["kernel"], np.full((2, 3), 2.0))
  np.testing.assert_array_equal(out["ffn"]["params"]["experts"]["w_up"], np.full((2, 2, 2), .5))
  assert set(out["q"]) == {"kernel"} and set(out["ffn"]) == {"params"}


def test_gate_up_keeps_a_gate_and_an_up_adapter_with_the_same_function():
  """A stored [W_gate | W_up] gets two adapters, each merged into its own half: the
  merge equals merging the two matrices apart and joining them."""
  w_gu = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)   # E=2, d=3, f=2
  params = {"experts": {"w_gate_up": w_gu, "w_down": jnp.ones((2, 2, 3))}}
  ad = lora_lib.init_moe_adapters(jax.random.key(0), params, ("experts",), 1)["experts"]
  assert {k: (v["a"].shape, v["b"].shape) for k, v in ad.items()} == {
      "w_gate": ((2, 3, 1), (2, 1, 2)), "w_up": ((2, 3, 1), (2, 1, 2)),
      "w_down": ((2, 2, 1), (2, 1, 3))}
  ad = {k: {"a": v["a"], "b": jnp.full(v["b"].shape, 1.0 + i)} for i, (k, v) in enumerate(
      ad.items())}
  got = lora_lib.merge_adapters(params, {"experts": ad}, 0.5)["experts"]
  apart = lora_lib.merge_adapters({"experts": experts_lib.split_layout(params["experts"])},
                                  {"experts": ad}, 0.5)["experts"]
  np.testing.assert_array_equal(got["w_gate_up"],
                                experts_lib.fuse_gate_up(apart["w_gate"], apart["w_up"]))
  np.testing.assert_array_equal(got["w_down"], apart["w_down"])
  # Only the up adapter: the gate half is unchanged.
  up_only = lora_lib.merge_adapters(params, {"experts": {"w_up": ad["w_up"]}}, 0.5)["experts"]
  np.testing.assert_array_equal(up_only["w_gate_up"][..., :2], w_gu[..., :2])
  assert not np.array_equal(up_only["w_gate_up"][..., 2:], w_gu[..., 2:])
