"""A capacity that leaves experts (almost) no slots: refused before training, or warned about
at the first logged step."""

from __future__ import annotations

import io

import pytest

from moejax.balance import capacity
from moejax.config import ConfigError
from moejax.train import guard, loop
from moejax.train.config import CAPACITY_FIELD, check_capacity
from tests.train import helpers

# configs/tiny.py: batch 8 x 32 tokens, 4 experts, top-2: T * K / E = 256 * 2 / 4 = 128 per
# expert, so capacity_factor 1/128 = 0.0078125 is exactly one slot per expert.


def test_slots_per_expert_and_the_drop_warning_bound():
  assert capacity.slots_per_expert(256, 4, 2, 1 / 128) == 1.0
  assert capacity.expert_capacity(256, 4, 2, 1e-9) == 1  # what training would silently use
  assert capacity.drop_warning(0.5, 0.01, "f") is None            # at the bound: quiet
  assert capacity.drop_warning(0.99, None, "f") is None           # dropless: nothing to say
  assert capacity.drop_warning(None, 0.01, "f") is None           # no drop metric logged
  assert capacity.drop_warning(0.984, 0.01, "f") == (
      "warning: 98.4% of token copies were dropped over the first logged steps (above 50%): "
      "f=0.01 leaves the experts (almost) no slots. Fix: raise f (Switch uses 1.25) or set it "
      "to None (dropless)")


def test_capacity_under_one_slot_per_expert_is_refused_naming_field_value_and_fix(data_dir):
  with pytest.raises(ConfigError) as err:
    helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=1e-9)
  assert str(err.value) == (
      f"{CAPACITY_FIELD}=1e-09: gives each of the 4 experts 1.28e-07 slots (cf * T * K / E "
      "with micro-batches of T=256 tokens, K=2), rounded up to 1: at most 4 of 512 token "
      "copies per group would reach an expert. Fix: use capacity_factor >= 0.00781 (one slot "
      "per expert), e.g. 1.25 (Switch), or None (dropless)")
  # Each micro-batch is a group: 4 of them quarter T, so 1/128 is no longer one slot.
  with pytest.raises(ConfigError, match=r"0\.25 slots .*T=64 tokens"):
    helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=1 / 128,
                       train__microbatches=4)
  helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=1 / 128)  # 1 slot


def test_expert_parallel_groups_are_one_device_s_rows(data_dir):
  # parallel.expert=4 with data=-1: at least 4 groups of 2 rows when built; on 8 devices 8
  # groups of 1 row (T=32), checked when the run sees its devices.
  cfg = helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=0.05,
                           parallel__expert=4)
  with pytest.raises(ConfigError, match=r"0\.8 slots \(cf \* T \* K / E with 8 devices' groups "
                                        r"of T=32 tokens.*>= 0\.0625"):
    check_capacity(cfg, 8)
  check_capacity(cfg, 4)
  with pytest.raises(ConfigError, match="4 devices' groups of T=64"):
    helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=0.03,
                       parallel__expert=4)


def test_a_run_dropping_most_copies_warns_once_at_its_first_row(tmp_path, data_dir):
  # capacity_factor 0.01: 2 slots per expert, 8 of 512 copies kept (98.4% dropped). The NaN
  # hook stops the run at step 2, after its first row, before any evaluation is compiled.
  cfg = helpers.experiment("tiny", data_dir, model__moe__balance__capacity_factor=0.01,
                           train__log_every=1, train__eval_every=0, train__nan_at_step=2)
  out = io.StringIO()
  with pytest.raises(guard.NonFiniteError, match="loss is nan at step 2"):
    loop.train(cfg, str(tmp_path / "run"), out=out)
  warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
  assert warnings == [capacity.drop_warning(504 / 512, 0.01, CAPACITY_FIELD)]
