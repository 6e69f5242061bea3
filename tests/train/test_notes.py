"""A restore's notes are said once per process and checkpoint (moejax.train.notes)."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.train import idea_restore
from moejax.train import notes


def test_a_note_is_new_once_per_kind_and_key():
  assert notes.first_time("k1", "/ckpt/a") and not notes.first_time("k1", "/ckpt/a")
  assert notes.first_time("k2", "/ckpt/a") and notes.first_time("k1", "/ckpt/b")
  assert notes.first_time("k1", None) and notes.first_time("k1", None)   # no key: every time


def test_grafting_the_same_checkpoint_again_says_its_note_once(capsys):
  path = "router_state/layer_0/ideas/memo/count"
  abstract = {"router_state": {"layer_0": {"ideas": {"memo": {
      "count": jax.ShapeDtypeStruct((2,), jnp.float32)}}}}}
  for _ in range(3):
    got = idea_restore.graft({"router_state": {"layer_0": {}}}, abstract, {path},
                             lambda p: np.ones(2), "checkpoint 5", once="/run/ckpt/5")
    np.testing.assert_array_equal(got["router_state"]["layer_0"]["ideas"]["memo"]["count"],
                                  np.ones(2, np.float32))
  said = [line for line in capsys.readouterr().err.splitlines() if "has no state" in line]
  assert said == ["note: checkpoint 5 has no state for memo (written before it declared "
                  "state): it starts from its initial value"]
