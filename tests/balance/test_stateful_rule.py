"""A stateful bias rule by hand: the balance rules docstring's ``ema_sign``, run as written.

Two experts, four tokens (three on expert 0, one on expert 1): the rule
observes copies per expert and tokens, its EMA (decay 0.9, from zeros) moves
to 0.1 x (3/4, 1/4), and the controller then moves the bias by
rate x sign(mean EMA - EMA) = (-rate, +rate), reading the state the update left.
"""

import re
import textwrap

import jax.numpy as jnp
import numpy as np

from moejax import balance
from moejax import layer as L
from moejax.balance.controller import update_bias
from moejax.config.registry import BIAS_RULES
from moejax.routing import IdeaState
from moejax.routing import state as state_lib
from moejax.routing.types import RoutingContext, make_result
from tests.configs import moe_config


def test_the_docstring_rule_by_hand():
  block = re.findall(r"::\n\n((?:    .*\n|\n)+)", balance.rules.__doc__)[3]
  assert "register_bias_rule(\"ema_sign\"" in block
  try:
    exec(textwrap.dedent(block), {"register_bias_rule": balance.register_bias_rule,  # noqa: S102
                                  "IdeaState": IdeaState, "jnp": jnp})
    cfg = moe_config(num_experts=2, expert_width=4, routing=dict(top_k=1, use_bias=True),
                     balance=dict(bias_update="ema_sign", bias_rate=0.1))
    state = L.init_router_state(cfg)
    np.testing.assert_array_equal(state.ideas["ema_sign"]["ema"], [0.0, 0.0])
    ids = jnp.asarray([[0], [0], [0], [1]], jnp.int32)
    p = jnp.full((4, 2), 0.5, jnp.float32)
    result = make_result(ids, jnp.ones((4, 1)), jnp.ones((4, 1), bool), p, jnp.log(p))
    seen = state_lib.observe(result, cfg, state.ideas, RoutingContext.build(4, train=True))
    np.testing.assert_array_equal(seen["ema_sign"]["load"], [3.0, 1.0])
    assert float(seen["ema_sign"]["tokens"]) == 4.0
    state = state.replace(ideas=state_lib.update(cfg, state.ideas, seen))
    np.testing.assert_allclose(state.ideas["ema_sign"]["ema"], [0.075, 0.025], rtol=1e-6)
    new = update_bias(state, jnp.asarray([3.0, 1.0]), cfg.balance)
    np.testing.assert_allclose(new.bias, [-0.1, 0.1], rtol=1e-6)
    assert new.ideas is state.ideas  # the controller reads the idea state, never writes it
  finally:
    BIAS_RULES.unregister("ema_sign")
