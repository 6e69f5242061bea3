"""Checkpoints of the layout before w_gate_up (separate w_gate / w_up) restore, joined."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.train import checkpoint as ckpt_lib
from moejax.train import layout_restore
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers


def _old_layout(tree):
  """The tree as a checkpoint from before w_gate_up stores it: each 'w_gate_up' [..., 2f]
  becomes 'w_gate' and 'w_up' [..., f] (written here apart from the code under test)."""
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      if k == "w_gate_up":
        f = v.shape[-1] // 2
        out["w_gate"], out["w_up"] = v[..., :f], v[..., f:]
      else:
        out[k] = _old_layout(v)
    return out
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_old_layout(v) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_old_layout(v) for v in tree)
  return tree


def _perturbed(tree):
  """Every float leaf moved by its own noise: Adam's moments are not zeros."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return treedef.unflatten([
      x + jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
      else x for x, k in zip(leaves, keys)])


def _old_layout_checkpoint(tmp_path):
  """(config, the state tree saved, its abstract tree): a run's step 0 in the old layout."""
  cfg = helpers.experiment("tiny", str(tmp_path / "data"))
  tx = make_optimizer(cfg.train, cfg.model)
  _, state = step_lib.init_state(cfg, tx)
  tree = _perturbed(state.checkpoint_tree())
  old = _old_layout(tree)
  paths = [p for p, _ in ckpt_lib.integrity.leaf_paths(old)]
  assert any(p.endswith("experts/w_gate") for p in paths if p.startswith("opt_state"))
  assert not any(p.endswith("w_gate_up") for p in paths)
  with ckpt_lib.Checkpointer(str(tmp_path / "run"), keep=1) as ckpt:
    ckpt.save(0, old, {"position": 0})
    ckpt.wait()
  _, abstract = step_lib.abstract_state(cfg, tx)
  return cfg, tree, abstract.checkpoint_tree()


def test_a_checkpoint_of_the_separate_gate_and_up_layout_restores_joined(tmp_path, capsys):
  cfg, tree, abstract = _old_layout_checkpoint(tmp_path)
  got = ckpt_lib.restore_latest(str(tmp_path / "run"), [0], abstract, cfg)
  assert got.verified and got.step == 0 and not got.skipped  # checksums of the old arrays
  assert "joined into w_gate_up" in capsys.readouterr().err
  want = dict(ckpt_lib.integrity.leaf_paths(tree))
  have = dict(ckpt_lib.integrity.leaf_paths(got.tree))
  assert set(have) == set(want)
  for path, value in want.items():
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(have[path]) if path == "rng"
                                             else have[path]),
                                  np.asarray(jax.random.key_data(value) if path == "rng"
                                             else value), err_msg=path)


def test_a_checkpoint_restored_again_in_one_process_says_its_note_once(tmp_path, capsys):
  """experiments.quantize restores its run once per scheme: one note, not four."""
  cfg, _, abstract = _old_layout_checkpoint(tmp_path)
  for _ in range(3):
    got = ckpt_lib.restore_latest(str(tmp_path / "run"), [0], abstract, cfg)
    assert got.verified and got.step == 0
  notes = [line for line in capsys.readouterr().err.splitlines() if "w_gate_up" in line]
  assert len(notes) == 1 and notes[0].startswith(
      "note: checkpoint 0 stores the routed experts' w_gate and w_up apart"), notes


def test_halves_join_on_a_block_axis_when_the_model_keeps_one():
  """Muon's momentum of a gate|up stack is kept per block, [E, d, 2, f]."""
  gate, up = jnp.arange(6.0).reshape(1, 2, 3), -jnp.arange(6.0).reshape(1, 2, 3)
  want = {"m": {"experts/w_gate_up": (1, 2, 2, 3)}, "p": {"experts/w_gate_up": (1, 2, 6)}}
  have = {"experts/w_gate": (1, 2, 3), "experts/w_up": (1, 2, 3)}
  for name, shape in (("m", (1, 2, 2, 3)), ("p", (1, 2, 6))):
    pairs = layout_restore.legacy_pairs(want[name], have)
    assert pairs == {"experts/w_gate_up": ((1, 2, 3), (1, 2, 3))}
    abstract = {"experts": {"w_gate_up": jax.ShapeDtypeStruct(shape, jnp.float32)}}
    target = layout_restore.legacy_target(abstract, pairs)
    assert {k: v.shape for k, v in target["experts"].items()} == {"w_gate": (1, 2, 3),
                                                                  "w_up": (1, 2, 3)}
    joined = layout_restore.join({"experts": {"w_gate": gate, "w_up": up}}, abstract, pairs,
                                 "test")
    value = np.asarray(joined["experts"]["w_gate_up"])
    assert value.shape == shape
    np.testing.assert_array_equal(value.reshape(1, 2, 2, 3)[:, :, 0] if name == "p"
                                  else value[:, :, 0], gate)
    back = layout_restore.as_saved(joined, pairs)["experts"]
    np.testing.assert_array_equal(back["w_gate"], gate)
    np.testing.assert_array_equal(back["w_up"], up)
  # A model that lacks w_gate_up, or halves of another shape, convert nothing.
  assert layout_restore.legacy_pairs({"experts/w_up": (1, 2, 3)}, have) == {}
  assert layout_restore.legacy_pairs({"experts/w_gate_up": (1, 2, 7)}, have) == {}
