"""A damaged checkpoint's part is named by what it is (moejax.train.damage), never by a repr.

Hand-made exceptions shaped like orbax's and TensorStore's check the wording
exactly; one private copy of the session's tiny run checks that an emptied
data-iterator state file is named as such by ``restore_latest``.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import damage
from moejax.train import load as load_lib
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer

# What orbax 0.12 raised for a truncated array file: a bare Exception whose text ends in a
# pybind11 repr and the TensorStore spec, raised from TensorStore's status.
_ORBAX = ("Encountered error while reading array index: (slice(0, 32, 1), slice(0, 16, 1)). "
          "See full TensorStore details: <bound method pybind11_detail_function_record_v1_"
          "system_libstdcpp_gxx_abi_1xxx_use_cxx11_abi_1.spec of TensorStore({\n  'base': {")
_TENSORSTORE = ('OUT_OF_RANGE: Error reading "opt_state.1.0.mu.blocks.0.attn.k_proj.kernel/0.0" '
                'in OCDBT database at local file "/w/checkpoints/40/state/": Requested byte '
                'range [9640, 11585) is not valid for value of size 10')


def _raised(outer: BaseException, cause: BaseException) -> BaseException:
  try:
    raise outer from cause
  except BaseException as e:  # pylint: disable=broad-except
    return e


def test_a_damaged_array_is_named_by_its_key_and_tensorstores_status():
  e = _raised(Exception(_ORBAX), ValueError(_TENSORSTORE))
  assert damage.restore_error(e) == (
      "its array opt_state.1.0.mu.blocks.0.attn.k_proj.kernel cannot be read (OUT_OF_RANGE: "
      "Requested byte range [9640, 11585) is not valid for value of size 10)")


def test_an_arrays_unreadable_metadata_behind_the_drivers_is_named_by_its_key():
  e = _raised(Exception(_ORBAX), ValueError(
      'OUT_OF_RANGE: Error opening "cast" driver: Error opening "zarr" driver: Error reading '
      '"opt_state.1.0.mu.blocks.0.attn.o_proj.kernel/.zarray" in OCDBT database at local file '
      '"/w/checkpoints/30/state/": Requested byte range [0, 193) is not valid for value of '
      'size 10'))
  assert damage.restore_error(e) == (
      "its array opt_state.1.0.mu.blocks.0.attn.o_proj.kernel cannot be read (OUT_OF_RANGE: "
      "Requested byte range [0, 193) is not valid for value of size 10)")


def test_without_tensorstores_cause_the_repr_is_cut_off():
  assert damage.restore_error(Exception(_ORBAX)) == (
      "its arrays cannot be restored (Exception: Encountered error while reading array index: "
      "(slice(0, 32, 1), slice(0, 16, 1)))")
  assert damage.metadata_error(ValueError(_ORBAX)) == (
      "its metadata cannot be read (ValueError: Encountered error while reading array index: "
      "(slice(0, 32, 1), slice(0, 16, 1)))")


@pytest.mark.parametrize("content, problem", [
    (None, "its data-iterator state file data/metadata is missing"),
    ("", "its data-iterator state file data/metadata is empty"),
    ("\n  ", "its data-iterator state file data/metadata is empty"),
    ('{"epoch": 0, "st', "its data-iterator state file data/metadata is not valid JSON "
     "(Unterminated string starting at: line 1 column 14 (char 13))"),
    ("[1, 2]", "its data-iterator state file data/metadata holds a list, not the iterator's "
     "state"),
    ('{"epoch": 0}', None),
])
def test_the_data_iterator_state_file_is_read_and_named(tmp_path, content, problem):
  (tmp_path / "data").mkdir()
  if content is not None:
    (tmp_path / "data" / "metadata").write_text(content)
  assert damage.data_state_problem(str(tmp_path)) == problem


def test_an_emptied_data_state_falls_back_and_is_named_as_such(tiny_copy):
  cfg, workdir = tiny_copy
  open(os.path.join(workdir, "checkpoints", "40", damage.DATA_STATE_FILE), "w").close()
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  restored = ckpt_lib.restore_latest(workdir, [30, 40], abstract.checkpoint_tree())
  assert restored.step == 30
  assert restored.skipped == ((40, "damaged, its data-iterator state file data/metadata is "
                                   "empty"),)
  with open(os.path.join(workdir, "checkpoints", "30", damage.DATA_STATE_FILE)) as f:
    assert restored.data_state == json.load(f)


def test_loading_a_damaged_checkpoint_names_the_part_and_the_earlier_one(tiny_copy):
  """moejax.load / generate / export_hf / quantize: the same names, the fixes of a load."""
  cfg, workdir = tiny_copy
  ck = os.path.join(workdir, "checkpoints")
  open(os.path.join(ck, "40", damage.DATA_STATE_FILE), "w").close()
  with pytest.raises(ckpt_lib.WorkdirError) as err:
    load_lib.model_at(cfg, workdir)
  assert str(err.value) == (
      f"checkpoint 40 in {ck} is damaged: its data-iterator state file data/metadata is empty. "
      "Fix: load an earlier checkpoint (step=30; kept: [30, 40]), or move it aside (mv "
      f"{ck}/40 {workdir}/damaged_checkpoints/40) and resume the run, which trains from the "
      "previous checkpoint")
  state = os.path.join(ck, "30", "state")
  for d, _, files in os.walk(state):
    for name in files:
      if os.sep + "d" + os.sep in os.path.join(d, name) + os.sep:
        with open(os.path.join(d, name), "r+b") as f:
          f.truncate(10)
  with pytest.raises(ckpt_lib.WorkdirError) as err:
    load_lib.model_at(cfg, workdir, step=30)
  msg = str(err.value)
  assert re.match(rf"checkpoint 30 in {re.escape(ck)} is damaged: its array [\w.]+ cannot be "
                  r"read \([A-Z_]+: .*\)\. Fix: retrain the run \(no earlier checkpoint is "
                  r"kept\)", msg), msg
  assert "TensorStore" not in msg and "pybind" not in msg
