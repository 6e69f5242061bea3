"""The results re-check: records of a suite's first steps, compared bit for bit."""

from __future__ import annotations

import json
import os

import optax
import pytest

from moejax.ablation import suite as suite_lib
from moejax.results import recheck, report
from tests.ablation import helpers

KIND = {"kind": {"platform": "cpu", "cpu": "X", "isa": ["avx2"], "jax": "1"}}
OTHER = {"kind": {"platform": "cpu", "cpu": "X", "isa": ["avx2", "avx512f"], "jax": "1"}}
UNREACHED = {"fingerprint": "u1", "parts": {"moejax/evaluate": "e1"}}


def _record(metrics, config=None):
  return {"id": "s", "steps": 3, "seed": 0, "environment": KIND, "unreached": UNREACHED,
          "code": {"fingerprint": "c1"},
          "arms": {a: {"metrics": m, "config": config or {"train.steps": 10}, "lr": "l"}
                   for a, m in metrics.items()}}


def _judge(record, now, configs=None, lr="l", env=KIND, unreached=UNREACHED):
  configs = configs or {a: {"train.steps": 10} for a in now}
  return recheck.judge(record, now, configs, {a: lr for a in now}, env, unreached)


def test_first_difference_is_the_earliest_step_then_arm_then_key():
  rec = {"a": {"loss": [3.0, 2.0, 1.0], "max_vio_batch": [0.5, 0.4, 0.3]},
         "b": {"loss": [3.0, 2.5, 1.5]}}
  now = {"a": {"loss": [3.0, 2.0, 1.1], "max_vio_batch": [0.5, 0.41, 0.3], "new_key": [1, 2, 3]},
         "b": {"loss": [3.0, 2.5, 1.5]}}
  d = recheck.first_difference(rec, now)
  assert (d.arm, d.key, d.step, d.recorded, d.now) == ("a", "max_vio_batch", 2, 0.4, 0.41)
  assert recheck.first_difference(rec, {**now, "a": rec["a"]}) is None  # new keys do not count
  gone = recheck.first_difference(rec, {"a": {"loss": [3.0, 2.0, 1.0]}, "b": rec["b"]})
  assert (gone.key, gone.now) == ("max_vio_batch", None)


def test_equal_numbers_are_current_and_one_ulp_is_stale():
  rec = _record({"a": {"loss": [3.0, 2.0, 1.0]}})
  assert _judge(rec, {"a": {"loss": [3.0, 2.0, 1.0]}}).verdict == "current"
  moved = _judge(rec, {"a": {"loss": [3.0, 2.0000000000000004, 1.0]}})
  assert moved.verdict == "stale"
  assert moved.reasons[0].startswith("first difference: arm a, loss at step 2: recorded 2.0, "
                                     "now 2.0000000000000004")


def test_another_machine_kind_is_never_stale_and_says_where_curves_part():
  rec = _record({"a": {"loss": [3.0, 2.0, 1.0]}})
  out = _judge(rec, {"a": {"loss": [3.0, 2.0, 1.5]}}, env=OTHER)
  assert out.verdict == "machine" and out.first.step == 3 and out.largest == pytest.approx(0.5)
  assert out.machine == ("isa: ['avx2'] -> ['avx2', 'avx512f']",)
  assert "the curves part at arm a, loss at step 3" in out.line("s", 3)
  same = _judge(rec, {"a": {"loss": [3.0, 2.0, 1.0]}}, env=OTHER)
  assert same.verdict == "machine" and same.first is None


def test_what_the_first_steps_cannot_reach_keeps_the_file_rule():
  rec = _record({"a": {"loss": [1.0]}})
  now = {"a": {"loss": [1.0]}}
  assert "moejax/evaluate" in _judge(rec, now, unreached={"fingerprint": "u2", "parts": {
      "moejax/evaluate": "e2"}}).reasons[0]
  changed = _judge(rec, now, configs={"a": {"train.steps": 20, "train.new_field": 1}})
  assert changed.verdict == "stale" and "train.steps: 10 -> 20" in changed.reasons[0]
  assert "new_field" not in changed.reasons[0]  # fields added later do not count
  assert _judge(rec, now, configs={"a": {"train.steps": 10, "x": 1}}).verdict == "current"
  assert "learning-rate schedule" in _judge(rec, now, lr="other").reasons[0]


def test_the_machine_line_names_the_cpu_and_its_widest_vector_extension():
  line = lambda env: recheck.machine_line({"environment": env})
  assert line(OTHER).startswith("- machine kind: X with AVX-512 (")
  flagged = {"kind": dict(OTHER["kind"], xla_flags="--xla_cpu_max_isa=AVX2")}
  assert "X with AVX-512, XLA_FLAGS `--xla_cpu_max_isa=AVX2` (" in line(flagged)
  assert line({"kind": {"cpu": "Y", "isa": []}}).startswith("- machine kind: Y with no AVX (")
  assert recheck.machine_line({}) == ""


def test_block_line_follows_the_record():
  rec = _record({"a": {"loss": [1.0]}})
  rec["unreached"] = recheck.unreached_fingerprint(recheck.UNREACHED)
  summ = {"provenance": {}}
  state, line = report.block_state(summ, rec, {"fingerprint": "c1"})
  assert state == "current" and "the runs' own code" in line
  assert report.block_state(summ, rec, {"fingerprint": "c2"})[0] == "due"
  rec["check"] = {"verdict": "current", "code": "c2", "reasons": [], "machine": []}
  state, line = report.block_state(summ, rec, {"fingerprint": "c2"})
  assert state == "current" and "retrain bit for bit" in line
  rec["check"] = {"verdict": "stale", "code": "c2", "reasons": ["first difference: x"],
                  "machine": []}
  assert report.block_state(summ, rec, {"fingerprint": "c2"}) == (
      "stale", "- **stale**: first difference: x; re-run the command below\n"
      "- machine kind: X with AVX2 (another kind gives other last digits: "
      "RESULTS.md's machine-spread tables measure how far they move)\n")
  assert report.block_state(summ, None, None)[0] == "unverified"  # no record: file rule


@pytest.fixture(scope="module")
def tiny_record(tiny_suite_dir):
  path, _, _ = tiny_suite_dir
  with open(os.path.join(path, "summary.json"), encoding="utf-8") as f:
    summ = json.load(f)
  record = recheck.make_record("tiny", path, summ)
  assert record is not None and record["steps"] == 6  # the tiny suite trains 6 steps
  assert set(record["arms"]) == {"aux", "bias"}
  assert "load/layer_0/0" in record["arms"]["bias"]["metrics"]
  return json.loads(json.dumps(record)), suite_lib.suite_from_dict(helpers.tiny_suite())


def test_a_change_that_moves_no_number_stays_current(tiny_record, monkeypatch):
  record, suite = tiny_record
  real = optax.adamw
  monkeypatch.setattr(optax, "adamw", lambda lr, **kw: real(lambda s: lr(s), **kw))
  out = recheck.recheck(record, suite, arms=["bias"])
  assert out.verdict == "current", out


def test_a_change_that_moves_a_number_is_stale_at_its_first_step(tiny_record, monkeypatch):
  record, suite = tiny_record
  real = optax.adamw
  monkeypatch.setattr(optax, "adamw", lambda lr, **kw: real(lambda s: lr(s) * 1.001, **kw))
  out = recheck.recheck(record, suite, arms=["bias"])
  assert out.verdict == "stale"
  # Warm-up starts at a rate of 0: the first update moves nothing, so step 3's loss is the
  # first computed from weights the scaled rate moved.
  assert out.first.step == 3 and out.first.arm == "bias"
  assert out.reasons[0].startswith("first difference: arm bias, ")


def _companion(metrics, code="c1", env=OTHER):
  return {"kind": env["kind"], "code": code, "metrics": metrics}


def test_a_companion_judges_another_machine_kind_as_the_record_does():
  rec = _record({"a": {"loss": [3.0, 2.0, 1.0]}})
  rec["companions"] = [_companion({"a": {"loss": [3.0, 2.5, 1.5]}})]
  same = _judge(rec, {"a": {"loss": [3.0, 2.5, 1.5]}}, env=OTHER)
  assert (same.verdict, same.companion, same.machine) == ("current", "c1", ())
  assert "as its companion record made at code `c1`" in same.line("s", 3)
  moved = _judge(rec, {"a": {"loss": [3.0, 2.5, 1.5000000000000002]}}, env=OTHER)
  assert moved.verdict == "stale" and moved.first.step == 3
  assert moved.reasons[0].startswith("first difference: arm a, loss at step 3: recorded 1.5,")
  # On the record's own kind the companion plays no part.
  assert _judge(rec, {"a": {"loss": [3.0, 2.0, 1.0]}}).verdict == "current"
  third = {"kind": dict(OTHER["kind"], xla_flags="--xla_cpu_max_isa=AVX2")}
  assert _judge(rec, {"a": {"loss": [3.0, 2.5, 1.5]}}, env=third).verdict == "machine"
  # A companion without one of the record's arms would leave it unjudged: not used.
  two = _record({"a": {"loss": [3.0]}, "b": {"loss": [2.0]}})
  two["companions"] = [_companion({"a": {"loss": [3.5]}})]
  assert _judge(two, {"a": {"loss": [3.5]}, "b": {"loss": [2.5]}}, env=OTHER).verdict == "machine"


def test_a_companion_is_made_only_where_the_block_is_known_current():
  rec = _record({"a": {"loss": [3.0, 2.0, 1.0]}})
  rec["unreached"] = recheck.unreached_fingerprint(recheck.UNREACHED)
  rec["check"] = {"verdict": "current", "code": "c2", "reasons": [], "machine": []}
  machine = recheck.Outcome("machine", machine=("isa: x -> y",),
                            values={"a": {"loss": [3.0, 2.5, 1.5]}})
  got = {"outcome": machine.as_dict(), "values": machine.values, "code": "c2",
         "environment": OTHER}
  assert "values" not in got["outcome"]
  made, yes = recheck.store_outcome(rec, got, {"fingerprint": "c2"})
  assert yes and made["check"] == rec["check"]  # the verdict on the own kind stays
  assert made["companions"] == [_companion({"a": {"loss": [3.0, 2.5, 1.5]}}, code="c2")]
  again, _ = recheck.store_outcome(made, dict(got, values={"a": {"loss": [0.0]}}),
                                   {"fingerprint": "c2"})
  assert [c["metrics"] for c in again["companions"]] == [{"a": {"loss": [0.0]}}]  # replaced
  stale = dict(rec, check=dict(rec["check"], verdict="stale", reasons=["x"]))
  for before, code_now in ((stale, "c2"), (rec, "c3")):  # not known current at this code
    kept, yes = recheck.store_outcome(before, got, {"fingerprint": code_now})
    assert not yes and "companions" not in kept and kept["check"]["verdict"] == "machine"


def test_the_block_line_names_the_companion_it_was_judged_against():
  rec = _record({"a": {"loss": [1.0]}})
  rec["unreached"] = recheck.unreached_fingerprint(recheck.UNREACHED)
  rec["check"] = {"verdict": "current", "code": "c2", "reasons": [], "machine": [],
                  "companion": "c1", "environment": OTHER}
  state, line = report.block_state({"provenance": {}}, rec, {"fingerprint": "c2"})
  assert state == "current"
  assert "re-checked on X with AVX-512: the first 3 steps of every arm retrain bit for bit " \
         "at code fingerprint `c2` as they did there at `c1`" in line
  rec["check"] = dict(rec["check"], verdict="stale", reasons=["first difference: x"])
  state, line = report.block_state({"provenance": {}}, rec, {"fingerprint": "c2"})
  assert state == "stale" and "(on X with AVX-512, against its companion record made at " \
                              "`c1`): first difference: x" in line


def test_a_companion_made_from_a_retrain_keeps_the_block_current_there(tiny_record):
  record, suite = tiny_record
  elsewhere = {**record, "environment": {"kind": dict(record["environment"]["kind"],
                                                     cpu="a CPU of another kind")}}
  first = recheck.recheck(elsewhere, suite, arms=["bias"])
  assert first.verdict == "machine" and first.first is None  # same numbers, other label
  env_now = recheck.environment()
  with_it = recheck.with_companion(elsewhere, env_now, "c", first.values)
  again = recheck.recheck(with_it, suite, arms=["bias"])
  assert (again.verdict, again.companion) == ("current", "c")


def test_a_block_is_re_checked_under_its_records_device_count_and_xla_flags():
  from experiments import recheck as binary  # pylint: disable=g-import-not-at-top
  rec = {"environment": {"kind": {"platform": "cpu", "devices": 8,
                                  "xla_flags": "--xla_cpu_max_isa=AVX2"}}}
  env = binary.child_env(rec, {"XLA_FLAGS": "--other", "HOME": "/h"})
  assert (env["JAX_NUM_CPU_DEVICES"], env["XLA_FLAGS"], env["HOME"]) == (
      "8", "--xla_cpu_max_isa=AVX2", "/h")
  plain = binary.child_env({"environment": {"kind": {"platform": "cpu", "devices": 1,
                                                     "xla_flags": ""}}}, {"XLA_FLAGS": "--x"})
  assert plain == {"XLA_FLAGS": ""}
