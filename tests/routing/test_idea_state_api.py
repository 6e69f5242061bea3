"""The IdeaState contract's errors: one line naming the idea, the field and the fix."""

import jax.numpy as jnp
import pytest

from moejax.balance import register_loss
from moejax.config.registry import BALANCE_LOSSES
from moejax.routing import IdeaState
from moejax.routing import state as state_lib
from tests.configs import moe_config


def _with_loss(name, st):
  register_loss(name, state=st)(lambda result, cfg, *, batch_shape, axis_names: 0.0)
  return moe_config(num_experts=4, balance=dict(extra_losses=((name, 1.0),)))


@pytest.mark.parametrize("update, match", [
    (lambda own, seen, cfg: {}, r"'bad_update': update returned fields \[\], its init "
                                r"declared \['n'\]. Fix: return every declared field"),
    (lambda own, seen, cfg: {"n": jnp.zeros((2,))},
     r"'bad_update': update returned n of shape \(2,\), declared \(\). Fix: keep"),
    (lambda own, seen, cfg: [own["n"]], r"'bad_update': update must return a mapping"),
])
def test_an_update_that_breaks_the_declaration_is_one_line(update, match):
  try:
    cfg = _with_loss("bad_update", IdeaState(lambda cfg: {"n": jnp.zeros((), jnp.int32)},
                                             update))
    with pytest.raises((ValueError, TypeError), match=match):
      state_lib.update(cfg, state_lib.init(cfg), {})
  finally:
    BALANCE_LOSSES.unregister("bad_update")


def test_an_update_keeps_each_fields_dtype_and_reads_no_gradient():
  try:
    cfg = _with_loss("counts", IdeaState(lambda cfg: {"n": jnp.zeros((), jnp.int32)},
                                         lambda own, seen, cfg: {"n": own["n"] + 1.0}))
    new = state_lib.update(cfg, state_lib.init(cfg), {})
    assert new["counts"]["n"].dtype == jnp.int32 and int(new["counts"]["n"]) == 1
  finally:
    BALANCE_LOSSES.unregister("counts")


def test_two_stateful_ideas_of_one_name_are_refused():
  st = IdeaState(lambda cfg: {"n": jnp.zeros(())}, lambda own, seen, cfg: own)
  register_loss("remoe", state=st)(lambda result, cfg, *, batch_shape, axis_names: 0.0)
  try:
    cfg = moe_config(num_experts=4, routing=dict(kind="remoe"),
                     balance=dict(extra_losses=(("remoe_l1", 1.0), ("remoe", 1.0))))
    with pytest.raises(ValueError, match="two stateful ideas of this config are named "
                                         "'remoe'; their state would share one key"):
      state_lib.init(cfg)
  finally:
    BALANCE_LOSSES.unregister("remoe")


def test_a_config_without_stateful_ideas_has_no_state():
  cfg = moe_config(num_experts=4)
  assert state_lib.declared(cfg) == () and state_lib.init(cfg) == {}
