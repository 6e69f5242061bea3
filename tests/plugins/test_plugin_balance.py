"""Balance rules from outside the package: one function and its registration each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.balance import controller
from moejax.config.registry import RegistryError
from moejax.routing.types import RouterState
from tests.configs import moe_config
from tests.plugins import balance_rules  # noqa: F401  (registers the rules)


def test_a_registered_loss_is_weighted_logged_and_added_to_the_total():
  cfg = moe_config(num_experts=4, expert_width=6, routing=dict(top_k=2),
                   balance=dict(z_loss_coef=1e-3, extra_losses=[["max_prob_loss", 0.5]]))
  assert cfg.balance.extra_losses == (("max_prob_loss", 0.5),)  # lists from JSON -> tuples
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8))
  _, aux = L.moe_layer(params, x, None, cfg)
  losses, probs = aux.losses, aux.routing.probs
  want = 0.5 * float(jnp.mean(jnp.max(probs, axis=-1)))
  np.testing.assert_allclose(float(losses["max_prob_loss"]), want, rtol=1e-6)
  np.testing.assert_allclose(float(losses["total"]),
                             float(losses["z_loss"]) + want, rtol=1e-6)


def test_a_registered_bias_rule_drives_the_controller():
  cfg = C.BalanceConfig(bias_update="tanh", bias_rate=0.1)
  load = jnp.array([4.0, 0.0, 2.0, 2.0])  # mean 2
  state = controller.update_bias(RouterState.zeros(4), load, cfg)
  np.testing.assert_allclose(np.asarray(state.bias), 0.1 * np.tanh([-2.0, 2.0, 0.0, 0.0]),
                             rtol=1e-6)


def test_unknown_colliding_and_misused_rules_are_one_line_errors():
  with pytest.raises(C.ConfigError, match=r"moe\.balance\.bias_update='tahn'.*did you mean "
                                          r"'tanh'"):
    C.BalanceConfig(bias_update="tahn")
  with pytest.raises(C.ConfigError, match=r"extra_losses='z_loss': is a shipped loss"):
    C.BalanceConfig(extra_losses=(("z_loss", 1.0),))
  with pytest.raises(RegistryError, match="already registered"):
    balance_rules.balance.register_loss("max_prob_loss")(lambda *a, **k: 0.0)
  with pytest.raises(C.ConfigError, match=r"moe\.balance\.extra_losses.*no effect with "
                                          r"moe\.kind='soft'"):
    moe_config("soft", num_experts=4, expert_width=6,
               balance=dict(extra_losses=(("max_prob_loss", 1e-2),)))
