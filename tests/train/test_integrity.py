"""Checkpoints that prove themselves (moejax.train.integrity): exact checksums, the restore
rule (verified / damaged / unverified), a flipped byte on disk, the NaN-after-resume message.

The on-disk tests work on private copies of the session's finished 40-step tiny
run (checkpoints 30 and 40, both written with checksums).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from moejax.train import checkpoint as ckpt_lib
from moejax.train import guard, integrity, loop, metrics_log
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

SHA_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256(b"")


def _sha(raw: bytes) -> str:
  return hashlib.sha256(raw).hexdigest()


def test_checksums_of_a_hand_made_tree_are_the_sha256_of_its_bytes():
  tree = {"a": jnp.arange(3, dtype=jnp.float32), "b": {"c": jnp.int32(7)},
          "e": np.zeros((0, 2), np.float32), "k": jax.random.key(0)}
  got = integrity.checksums(tree)
  assert got == {
      # 0.0, 1.0, 2.0 as little-endian float32
      "a": {"sha256": _sha(b"\x00\x00\x00\x00\x00\x00\x80\x3f\x00\x00\x00\x40"),
            "shape": [3], "dtype": "float32"},
      "b/c": {"sha256": _sha(b"\x07\x00\x00\x00"), "shape": [], "dtype": "int32"},
      "e": {"sha256": SHA_EMPTY, "shape": [0, 2], "dtype": "float32"},
      # a typed PRNG key is checksummed as its uint32 key data (what orbax stores)
      "k": {"sha256": _sha(np.asarray(jax.random.key_data(tree["k"])).tobytes()),
            "shape": [2], "dtype": "uint32"},
  }
  # The data state's digest is its canonical JSON: key order is not content.
  assert (integrity.data_digest({"epoch": 1, "pos": [3, 4]})
          == integrity.data_digest({"pos": [3, 4], "epoch": 1})
          == _sha(b'{"epoch": 1, "pos": [3, 4]}'))


def test_verify_names_exactly_the_changed_leaf():
  tree = {"a": jnp.arange(3, dtype=jnp.float32), "b": jnp.ones((2, 2), jnp.bfloat16)}
  recorded = integrity.checksums(tree)
  assert integrity.verify(tree, recorded) == ([], [])
  # One ulp in one element: finite, and only the checksum sees it.
  nudged = dict(tree, a=tree["a"].at[1].set(np.nextafter(np.float32(1), np.float32(2))))
  bad, unverified = integrity.verify(nudged, recorded)
  assert [m.path for m in bad] == ["a"] and unverified == []
  assert bad[0].why.startswith("sha256 ") and bad[0].why.endswith("recorded")
  reshaped = dict(tree, b=jnp.ones((4,), jnp.bfloat16))
  assert [str(m) for m in integrity.verify(reshaped, recorded)[0]] == [
      "b: saved as bfloat16[2, 2], restored as bfloat16[4]"]
  # A recorded leaf that is gone is damage; a leaf the record lacks is only unverified.
  bad, unverified = integrity.verify({"a": tree["a"], "z": jnp.zeros(1)}, recorded)
  assert [str(m) for m in bad] == ["b: recorded but not in the restored state"]
  assert unverified == ["z"]
  # A leaf recorded as unreadable (sharded over processes when it was saved) is unverified.
  bad, unverified = integrity.verify(tree, dict(recorded, b={"unverified": integrity.SHARDED}))
  assert bad == [] and unverified == ["b"]


def test_verify_step_rule_verified_damaged_unverified(tmp_path):
  tree, data = {"w": jnp.arange(4.0)}, {"pos": 5}
  d = str(tmp_path)
  none = integrity.verify_step(d, tree, data)
  assert not none.verified and not none.mismatches
  assert none.note.startswith("unverified: no checksums.json")
  integrity.write(d, integrity.record(tree, data))
  ok = integrity.verify_step(d, tree, data)
  assert ok.verified and ok.note == "verified: 1 arrays and the data state match checksums.json"
  moved = integrity.verify_step(d, tree, {"pos": 6})
  assert [m.path for m in moved.mismatches] == ["data"]
  with open(os.path.join(d, integrity.FILE), "w") as f:
    f.write('{"format": 1, "algorithm": "sha256", "arr')  # torn: proves nothing
  torn = integrity.verify_step(d, tree, data)
  assert torn.mismatches and torn.note.startswith("damaged: its checksums.json cannot be read")


def test_checksums_are_written_only_once_orbax_committed_the_step(tmp_path):
  tree, data = {"w": jnp.arange(4.0), "s": jnp.int32(2)}, {"pos": 1}
  with ckpt_lib.Checkpointer(str(tmp_path), keep=1) as ckpt:
    ckpt.save(1, tree, data)
    assert set(ckpt._pending) == {1}  # held, not yet written into orbax's directory
    ckpt.save(2, tree, data)            # waits for step 1 first: its checksums are written then
    ckpt.wait()
    assert ckpt._pending == {}
  assert ckpt_lib.checkpoint_steps(str(tmp_path)) == [2]  # step 1 pruned with its checksums
  with open(os.path.join(tmp_path, "checkpoints", "2", integrity.FILE)) as f:
    assert json.load(f) == json.loads(json.dumps(integrity.record(tree, data)))


def _abstract(cfg):
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  return abstract.checkpoint_tree()


def test_a_checkpoint_without_checksums_is_accepted_unverified(tiny_copy):
  cfg, workdir = tiny_copy
  os.remove(os.path.join(workdir, "checkpoints", "40", integrity.FILE))
  restored = ckpt_lib.restore_latest(workdir, [30, 40], _abstract(cfg))
  assert restored.step == 40 and not restored.verified and restored.skipped == ()
  assert restored.integrity.startswith("unverified: no checksums.json")


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_previous_one(tiny_copy):
  cfg, workdir = tiny_copy
  before = {r["step"]: r for r in metrics_log.read_metrics(workdir, "train")}
  abstract = _abstract(cfg)
  helpers.flip_one_byte(workdir, 40, abstract)
  # Without its checksums the damage is invisible: checkpoint 40 restores, finite.
  unchecked = os.path.join(os.path.dirname(workdir), "unchecked")
  shutil.copytree(os.path.join(workdir, "checkpoints", "40"),
                  os.path.join(unchecked, "checkpoints", "40"))
  os.remove(os.path.join(unchecked, "checkpoints", "40", integrity.FILE))
  blind = ckpt_lib.restore_latest(unchecked, [40], abstract)
  assert blind.step == 40 and guard.nonfinite_leaves(blind.tree) == []
  # With them, restore names the leaf and falls back.
  restored = ckpt_lib.restore_latest(workdir, [30, 40], abstract)
  assert restored.step == 30 and restored.verified
  (step, why), = restored.skipped
  assert step == 40 and why.startswith("damaged: 1 value differs from the checksums recorded")
  leaf = why.split("(", 1)[1].split(":", 1)[0]
  assert leaf in integrity.checksums(restored.tree)  # a real leaf path of the state
  # The run itself: says so, moves 40 aside, trains 30 -> 40 again to the same numbers.
  out = io.StringIO()
  loop.train(cfg, workdir, out=out)
  text = out.getvalue()
  moved = os.path.join(workdir, ckpt_lib.DAMAGED_DIR, "40")
  assert f"checkpoint 40 is {why}; moved to {moved}" in text
  assert "falling back to checkpoint 30" in text
  assert "resumed from checkpoint at step 30 (verified: 71 arrays and the data state match" in text
  assert os.path.isdir(moved) and ckpt_lib.checkpoint_steps(workdir) == [30, 40]
  assert integrity.verify_step(os.path.join(workdir, "checkpoints", "40"),
                               blind.tree, blind.data_state).mismatches  # rewritten, new sums
  after = {r["step"]: r for r in metrics_log.read_metrics(workdir, "train")}
  assert after[40]["loss"] == before[40]["loss"]


class _Ckpt:
  """The two things the NaN guard's message reads of a Checkpointer."""

  def __init__(self, latest, resumed):
    self.latest, self.resumed = latest, resumed

  def wait(self):
    pass

  def latest_step(self):
    return self.latest


def test_nan_soon_after_a_resume_says_the_resume_checkpoint_may_be_damaged(tmp_path):
  workdir = str(tmp_path)
  for s in (20, 30):
    os.makedirs(os.path.join(workdir, "checkpoints", str(s)))
  ck, dmg = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "damaged_checkpoints")
  resumed = ckpt_lib.Restored(30, None, {}, verified=False)
  text = loop._last_good(_Ckpt(30, resumed), workdir, 33)
  assert text == (
      "the run resumed from checkpoint 30 3 step(s) before this and has saved none since, so "
      "checkpoint 30 itself may be damaged (it had no checksums to verify it against). Fix: "
      f"move it aside (mv {ck}/30 {dmg}/30) and run the same command again, which resumes from "
      "checkpoint 20; only if the NaN comes back from there: lower train.learning_rate, raise "
      "train.warmup_steps or set train.grad_clip, and run in a new --workdir (this one's "
      "config.json describes its checkpoints)")
  verified = ckpt_lib.Restored(30, None, {}, verified=True)
  assert "its arrays matched the checksums" in loop._last_good(_Ckpt(30, verified), workdir, 31)
  # A checkpoint saved since the resume passed the finite check: the old message.
  assert loop._last_good(_Ckpt(40, resumed), workdir, 43).startswith(
      f"the last good checkpoint (checked finite before it was saved) is step 40 in {ck}. Fix: "
      "lower train.learning_rate")
  assert loop._last_good(_Ckpt(None, None), workdir, 3).startswith(
      "no checkpoint was written before it. Fix: lower")
  # No earlier checkpoint: moving the suspect aside trains from step 0.
  only = integrity.resume_suspect(20, False, 20, 21, [20], ck, dmg, loop._FIX)
  assert "which trains the run again from step 0 (no earlier checkpoint)" in only
