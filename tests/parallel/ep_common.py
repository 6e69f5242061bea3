"""Shared pieces of the expert-parallel child scripts (imported after JAX is configured).

The oracles:

* ``full``: the single-device reference layer (``backend='reference'``) on the
  whole batch; the expert-parallel layer must equal it for token-choice
  routing without capacity (outputs, gradients, loads, metrics, losses,
  controller state).
* ``per_shard``: the single-device reference layer applied to every
  device's shard (vmap over shards); the documented semantics of capacity
  and expert choice (decisions per group), so outputs, gradients, drops and
  routing must equal it for every router.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.configs import moe_config
from moejax import config as C
from moejax import layer as L
from moejax.balance import controller

B, S, DM = 16, 4, 8  # 16 sequences = 2 per device on 8 devices

CASES = {
    "mixtral": dict(routing=dict(top_k=2, gating="topk_softmax"),
                    balance=dict(aux_loss_coef=0.01, aux_loss_scope="global", z_loss_coef=1e-3)),
    "switch_capacity": dict(routing=dict(top_k=1, gating="scores"), capacity_factor=0.75,
                            balance=dict(aux_loss_coef=0.01)),
    "score_capacity": dict(routing=dict(top_k=2), capacity_factor=0.5, drop_priority="score"),
    "deepseek_v3": dict(num_shared_experts=1,
                        routing=dict(top_k=2, score_fn="sigmoid", use_bias=True, n_groups=4,
                                    topk_groups=2, routed_scaling_factor=2.5),
                        balance=dict(bias_update="sign", aux_loss_coef=1e-3,
                                     aux_loss_scope="sequence")),
    "expert_choice": dict(routing=dict(kind="expert_choice", capacity=2.0)),
    "hash": dict(routing=dict(kind="hash", top_k=1)),
    "top_p_zero_compute": dict(zero_experts=1, copy_experts=1, constant_experts=1,
                               routing=dict(kind="top_p", top_k=3, top_p=0.5)),
    "hierarchical": dict(routing=dict(kind="hierarchical", n_families=2, top_k_families=1,
                                     top_k=2)),
    "gelu_heterogeneous": dict(activation="gelu", expert_widths=(2, 6, 4, 6, 8, 3, 5, 7)),
}
# Routing of these depends on other tokens of the batch: compared per shard.
PER_GROUP = ("switch_capacity", "score_capacity", "expert_choice")


def make_cfg(name: str, backend: str = "reference", **extra) -> C.MoEConfig:
  base = dict(num_experts=8, expert_width=8, backend=backend)
  base.update(CASES[name])
  base.update(extra)
  return moe_config(**base)


def inputs(cfg: C.MoEConfig, seed: int = 0, batch: int = B):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = L.init_moe_params(k[0], DM, cfg)
  x = jax.random.normal(k[1], (batch, S, DM), jnp.float32)
  ids = jax.random.randint(k[2], (batch, S), 0, 256)
  return params, x, ids


def _objective(y, aux):
  return jnp.sum(jnp.sin(y)) + aux.losses["total"]


def _controller(cfg, state, aux, train):
  """The train step's controller update (once, outside the gradient) on the layer's loads."""
  return controller.update_bias(state, aux.router_load, cfg.balance) if train else state


def ep_fn(cfg, mesh, pcfg, *, train=False, placement=None):
  """jit: (params, x, ids, state) -> (y, new_state, aux, grads wrt (params, x))."""
  def run(params, x, ids, state):
    def loss(p, x):
      y, aux = L.ep_moe_layer(p, x, state, cfg, mesh, pcfg, token_ids=ids,
                              train=train, placement=placement)
      return _objective(y, aux), (y, aux)
    (_, (y, aux)), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    return y, _controller(cfg, state, aux, train), aux, g
  return jax.jit(run)


def full_fn(cfg, *, train=False):
  def run(params, x, ids, state):
    def loss(p, x):
      y, aux = L.moe_layer(p, x, state, cfg, token_ids=ids, train=train)
      return _objective(y, aux), (y, aux)
    (_, (y, aux)), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    return y, _controller(cfg, state, aux, train), aux, g
  return jax.jit(run)


def per_shard_fn(cfg, shards: int):
  """Reference of the grouped semantics: the layer on each shard, losses averaged."""
  def run(params, x, ids, state):
    def loss(p, x):
      xs = x.reshape((shards, -1) + x.shape[1:])
      idss = ids.reshape((shards, -1) + ids.shape[1:])
      y, aux = jax.vmap(lambda a, i: L.moe_layer(p, a, state, cfg, token_ids=i))(xs, idss)
      y = y.reshape(x.shape)
      total = jnp.sum(jnp.sin(y)) + jnp.mean(aux.losses["total"])
      return total, (y, aux)
    (_, (y, aux)), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    return y, aux, g
  return jax.jit(run)


def close(a, b, what, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=what)


def close_tree(a, b, what, tol=2e-5):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(la) == len(lb), f"{what}: {len(la)} leaves vs {len(lb)}"
  for (path, x), y in zip(la, lb):
    close(x, y, f"{what}{jax.tree_util.keystr(path)}", tol)
