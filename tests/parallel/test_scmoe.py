"""ScMoE (model.moe_schedule='scmoe'): config rules, equal budget, the shortcut dependency.

Tiny decoder (d=16, 2 layers, the second one MoE with E=4 and a shared
expert). The schedule's point is a data dependency: a ScMoE block's routed
experts must not depend on that block's attention, so their all-to-all can
overlap it; the serial block's must.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import layer as L
from moejax.config import BalanceConfig, ConfigError, ModelConfig, MoEConfig, RoutingConfig
from moejax.model import Transformer, param_count
from moejax.nn.moe_block import values
from moejax.topology import experts as experts_lib
from tests.configs import moe_config, replace_moe

V = 32


def cfg(schedule="scmoe", **kw):
  moe = moe_config(num_experts=4, expert_width=8, num_shared_experts=1,
                  routing=RoutingConfig(top_k=2, score_fn="sigmoid", use_bias=True),
                  balance=BalanceConfig(bias_update="sign"))
  base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, dense_ff_width=32,
              moe_layout="every_other", moe_schedule=schedule, moe=moe)
  base.update(kw)
  return ModelConfig(**base)


def test_config_rules():
  with pytest.raises(ConfigError, match="model.moe_schedule='scmoe'.*layer 0 is an MoE layer"):
    cfg(moe_layout="all")
  with pytest.raises(ConfigError, match="model.mod_every"):
    cfg(mod_every=2)
  with pytest.raises(ConfigError, match="needs moe.kind='sparse'"):
    cfg(moe=None)
  with pytest.raises(ConfigError, match="did you mean 'scmoe'"):
    cfg(schedule="scmo")
  cfg(moe_layout="first_dense", first_dense_layers=1)


@pytest.fixture(scope="module")
def models():
  return {s: Transformer(cfg(s), rngs=nnx.Rngs(0)) for s in ("serial", "scmoe")}


@nnx.jit
def _routing(model, tokens):
  _, aux = model(tokens)
  return aux["moe"]["layer_1"]["expert_ids"], aux["moe"]["layer_1"]["weights"]


def test_same_parameters_and_state_as_serial(models):
  serial, sc = (nnx.state(models[s], nnx.Param) for s in ("serial", "scmoe"))
  assert param_count(models["serial"]) == param_count(models["scmoe"])
  assert jax.tree.structure(serial) == jax.tree.structure(sc)
  for a, b in zip(jax.tree.leaves(serial), jax.tree.leaves(sc)):
    np.testing.assert_array_equal(a, b)  # same init: only the schedule differs


def test_routed_branch_reads_the_previous_block_not_this_attention(models):
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, V)
  changed = {}
  for schedule, model in models.items():
    before = _routing(model, tokens)
    attn = model.blocks[1].attn
    saved = jax.tree.map(lambda v: v[...], nnx.state(attn, nnx.Param))
    nnx.update(attn, jax.tree.map(lambda a: a + 0.5, saved))
    after = _routing(model, tokens)
    nnx.update(attn, saved)
    changed[schedule] = not all(np.array_equal(a, b) for a, b in zip(before, after))
  assert changed == {"serial": True, "scmoe": False}


def test_block_equals_hand_composition(models):
  model = models["scmoe"]
  x = jax.random.normal(jax.random.key(2), (2, 6, 16))
  tap = jax.random.normal(jax.random.key(3), (2, 6, 16))
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  ids = jnp.zeros((2, 6), jnp.int32)
  block = model.blocks[1]
  got, aux, h = block(x, pos, ids, shortcut=tap, return_tap=True)

  x1 = x + block.attn(block.attn_norm(x), pos)
  np.testing.assert_allclose(h, block.ffn_norm(x1), rtol=1e-6)
  params = values(block.ffn.params)
  moe = block.ffn.cfg
  routed_cfg = replace_moe(moe, num_shared_experts=0)
  routed, _ = L.moe_layer({k: v for k, v in params.items() if k != "shared"}, tap,
                             values(block.ffn.router_state), routed_cfg)
  shared = experts_lib.apply_shared(params["shared"], h.reshape(-1, 16)).reshape(h.shape)
  np.testing.assert_allclose(got, x1 + shared + routed, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="previous block's FFN input"):
    block(x, pos, ids)


def test_controller_updates_router_state_from_the_shortcut(models):
  model = models["scmoe"]
  tokens = jax.random.randint(jax.random.key(4), (2, 6), 0, V)
  bias0 = np.array(model.blocks[1].ffn.router_state.bias[...])
  logits, aux = model(tokens, train=True)
  assert logits.shape == (2, 6, V) and np.isfinite(np.asarray(logits)).all()
  assert set(aux["moe"]) == {"layer_1"}
  # The forward never writes the state; the controller step does, on the loads
  # of the routed input (the shortcut).
  np.testing.assert_array_equal(np.asarray(model.blocks[1].ffn.router_state.bias[...]), bias0)
  model.apply_controllers({k: v["router_load"] for k, v in aux["moe"].items()})
  assert not np.array_equal(np.asarray(model.blocks[1].ffn.router_state.bias[...]), bias0)
