"""Provenance of plugin balance rules: recorded with their module, re-imported on load.

A run whose only plugin is a balance loss (tests/plugins/balance_rules.py)
records the module in plugins.json, a fresh process reads it back with
moejax.load, and a module that cannot be found fails in one line whose fix
works. A module that registers several ideas is one record listing all of
them; a suite rerun after the plugin changed says which runs it reuses.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import moejax
from moejax.ablation import provenance, summary as summary_lib
from moejax.config import plugins as plugins_lib
from moejax.config.registry import BALANCE_LOSSES, BIAS_RULES
from moejax.train import loop
from tests import shared_dirs
from tests.plugins import balance_rules  # noqa: F401  (registers the loss and the rule)
from tests.train import helpers

HERE = pathlib.Path(__file__).resolve().parent
MODULE = "tests.plugins.balance_rules"


@pytest.fixture(scope="module")
def loss_only_run(request, tmp_path_factory):
  """A 2-step tiny run whose one plugin is the balance loss max_prob_loss."""
  data_dir = str(shared_dirs.build_once(request, "tfds", lambda path: None))
  cfg = helpers.experiment(
      "tiny", data_dir, train__steps=2, train__log_every=1, train__eval_every=2,
      train__eval_batches=1, train__checkpoint_every=2, train__warmup_steps=1,
      model__moe__balance__extra_losses=(("max_prob_loss", 0.5),))
  workdir = tmp_path_factory.mktemp("loss_only") / "run"
  loop.train(cfg, str(workdir), out=open(os.devnull, "w"))
  return cfg, workdir


def _python(code, cwd, env=None):
  full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  full.update(JAX_PLATFORMS="cpu", **(env or {}))
  return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full, capture_output=True,
                        text=True, timeout=300)


def test_a_plugin_loss_and_rule_are_recorded_as_their_module_not_moejax():
  assert BALANCE_LOSSES.plugins()["max_prob_loss"] == MODULE
  assert BIAS_RULES.plugins()["tanh"] == MODULE
  assert "z_loss" not in BALANCE_LOSSES.plugins() and "sign" not in BIAS_RULES.plugins()


def test_a_module_registering_several_ideas_is_one_record_with_all_of_them():
  tree = {"model": {"moe": {"kind": "sparse", "routing": {"kind": "topk"},
                            "balance": {"extra_losses": [["max_prob_loss", 0.5]],
                                        "bias_update": "tanh"}}},
          "parallel": {"dispatch_unit": "token"}}
  records = plugins_lib.used(tree)
  assert [r["module"] for r in records] == [MODULE]
  assert records[0]["ideas"] == [
      {"registry": "balance loss", "name": "max_prob_loss",
       "field": "model.moe.balance.extra_losses"},
      {"registry": "bias rule", "name": "tanh", "field": "model.moe.balance.bias_update"}]
  assert records[0]["file"] == str(HERE / "balance_rules.py")
  # Records written one per idea (before) are read as one per module.
  old = [{"module": MODULE, "file": "f", "sha256": "s", "registry": i["registry"],
          "name": i["name"], "field": i["field"]} for i in records[0]["ideas"]]
  assert plugins_lib.normalise(old) == [dict(records[0], file="f", sha256="s")]


def test_a_run_whose_only_plugin_is_a_loss_loads_in_a_fresh_process(loss_only_run, tmp_path):
  _, work = loss_only_run
  record = json.loads((work / "plugins.json").read_text())
  assert [(r["module"], r["ideas"]) for r in record] == [
      (MODULE, [{"registry": "balance loss", "name": "max_prob_loss",
                 "field": "model.moe.balance.extra_losses"}])]
  code = ("import moejax; m, c = moejax.load(%r); "
          "print('OK', c.model.moe.balance.extra_losses)")
  # Another directory, no PYTHONPATH: the module is imported from its recorded file.
  out = _python(code % str(work), cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("OK", 1)[1].strip() == "(('max_prob_loss', 0.5),)"
  assert "warning" not in out.stderr
  # The module moved: one line naming it and the folder to put on PYTHONPATH ...
  moved = tmp_path / "moved"
  shutil.copytree(work, moved)
  record[0].update(module="my_rules", file=str(tmp_path / "gone" / "my_rules.py"))
  (moved / "plugins.json").write_text(json.dumps(record))
  with pytest.raises(plugins_lib.PluginError) as e:  # before the config is built
    moejax.load(str(moved))
  last = str(e.value)
  assert "\n" not in last and last.startswith(
      "plugin module 'my_rules' (which registers balance loss 'max_prob_loss') cannot be "
      "imported here"), last
  assert "Fix: put the folder that holds my_rules.py on PYTHONPATH" in last
  # ... and that fix works.
  (tmp_path / "lib").mkdir()
  shutil.copy(HERE / "balance_rules.py", tmp_path / "lib" / "my_rules.py")
  out = _python(code % str(moved), cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "lib")})
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout and "warning" not in out.stderr


def test_a_changed_plugin_is_named_for_every_run_a_suite_would_reuse(loss_only_run, tmp_path):
  _, work = loss_only_run
  suite = tmp_path / "suite"
  shutil.copytree(work, suite / "arm" / "seed_0")
  plan = {"arm/seed_0": "finished", "other/seed_0": "new"}
  assert provenance.plugin_changes(str(suite), plan) == []  # the same file: nothing to say
  record = json.loads((work / "plugins.json").read_text())
  record[0]["sha256"] = "0" * 64  # as if made by another version of the module
  (suite / "arm" / "seed_0" / "plugins.json").write_text(json.dumps(record))
  lines = provenance.plugin_changes(str(suite), plan)
  assert len(lines) == 1 and lines[0].startswith(
      f"! arm/seed_0: plugin module '{MODULE}' changed since the run was made (sha256 "
      "000000000000 -> "), lines
  assert "reused as it is" in lines[0] and "Fix: move" in lines[0]
  resumed = provenance.plugin_changes(str(suite), {"arm/seed_0": "resumes from step 1"})
  assert "resumes from step 1 on the current version" in resumed[0]


def test_the_suite_summary_carries_the_plugins_and_flags_two_versions():
  rec = lambda sha: [{"module": MODULE, "file": str(HERE / "balance_rules.py"), "sha256": sha,
                      "ideas": [{"registry": "balance loss", "name": "max_prob_loss",
                                 "field": "model.moe.balance.extra_losses"}]}]
  now = plugins_lib.used({"model": {"moe": {"balance": {
      "extra_losses": [["max_prob_loss", 1.0]]}}}})[0]["sha256"]
  results = [{"arm": "a", "seed": s, "run": f"a/seed_{s}", "val_loss": 1.0,
              "provenance": {"commit": "c", "plugins": rec(sha)}}
             for s, sha in ((0, now), (1, "1" * 64))]
  prov = summary_lib._collect_provenance(results)  # pylint: disable=protected-access
  assert [(p["sha256"], p["runs"]) for p in prov["plugins"]] == [
      (now, ["a/seed_0"]), ("1" * 64, ["a/seed_1"])]
  assert prov["plugin_flags"][0].startswith(f"plugin module '{MODULE}' was recorded in 2 "
                                            "versions")
  assert prov["plugin_flags"][1].endswith(": runs a/seed_1")  # the file is not that one now
  lines = "\n".join(summary_lib.tables.provenance_lines({"provenance": prov}))
  assert f"- plugin `{MODULE}` (balance loss `max_prob_loss`): sha256 `{now[:12]}`" in lines
  assert "- ! plugin module" in lines
  assert "plugins" not in summary_lib._collect_provenance(  # pylint: disable=protected-access
      [{"arm": "a", "provenance": {"commit": "c"}}])


# --- Every balance loss logged under its name (metrics.jsonl, TensorBoard, the summary). ---

def test_each_weighted_loss_is_summed_over_layers_and_only_those_in_the_objective():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from moejax import config as C  # pylint: disable=g-import-not-at-top
  from moejax.train import step  # pylint: disable=g-import-not-at-top
  balance = C.BalanceConfig(aux_loss_coef=1e-2, extra_losses=(("max_prob_loss", 0.5),))
  layer = lambda a, p: {"losses": {"aux_loss": jnp.float32(a), "z_loss": jnp.float32(0.0),
                                   "max_prob_loss": jnp.float32(p),
                                   "total": jnp.float32(a + p)}}
  aux = {"moe": {"layer_0": layer(0.25, 0.5), "layer_1": layer(0.5, 0.125)}}
  got = {k: float(v) for k, v in step.balance_loss_summary(aux, balance).items()}
  assert got == {"balance/aux_loss": 0.75, "balance/max_prob_loss": 0.625}  # z_loss: coef 0
  assert step.balance_loss_summary(aux, None) == {}  # a dense model


def _scalar_tags(tb_dir):
  import glob  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  tags = set()
  for path in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
    data = pathlib.Path(path).read_bytes()
    at = 0
    while at + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
      at += 12 + n + 4
      tags.update(v.tag for v in event.summary.value if v.HasField("simple_value"))
  return tags


def test_every_loss_of_the_run_is_logged_under_its_name_and_summarised(loss_only_run, tmp_path):
  from moejax.ablation import runner, tables  # pylint: disable=g-import-not-at-top
  from moejax.train import metrics_log  # pylint: disable=g-import-not-at-top
  _, work = loss_only_run
  names = {"balance/aux_loss", "balance/z_loss", "balance/max_prob_loss"}  # configs/tiny.py's
  rows = metrics_log.read_metrics(str(work), "train")
  assert [r["step"] for r in rows] == [1, 2]
  for row in rows:
    assert {k for k in row if k.startswith("balance/")} == names
    # The weighted losses make up the aux loss of the objective (no mixture-of-depths).
    assert sum(row[k] for k in names) == pytest.approx(row["aux_loss"], rel=1e-5)
    assert 0.0 < row["balance/max_prob_loss"] <= 2 * 0.5  # 2 layers x 0.5 x a probability
  assert {f"train/{k}" for k in names} <= _scalar_tags(str(work / metrics_log.TENSORBOARD_DIR))
  # The suite's result (mean over the second half of training) and summary.
  res = dict(runner.train_metrics(str(work)), arm="a", seed=0)
  assert res["balance/max_prob_loss"] == rows[-1]["balance/max_prob_loss"]
  summary = summary_lib.summarise_results([res])
  got = summary["arms"]["a"]["metrics"]["balance/max_prob_loss"]["interval"]["mean"]
  assert got == res["balance/max_prob_loss"]
  table = tables.balance_loss_table(summary)
  assert "| arm | `aux_loss` | `max_prob_loss` | `z_loss` |" in table
  summary_lib.write_csv(summary, str(tmp_path / "s.csv"))
  assert "balance/max_prob_loss" in (tmp_path / "s.csv").read_text().splitlines()[0]


def test_a_plugin_layer_kind_and_executor_are_recorded_too():
  from moejax.config.registry import EXECUTORS, LAYERS  # pylint: disable=g-import-not-at-top

  class Kind:  # only its registration is read here
    name = "test_provenance_kind"

  class Executor:
    name = "test_provenance_unit"

  LAYERS.register(Kind())
  EXECUTORS.register(Executor)
  try:
    tree = {"model": {"moe": {"kind": Kind.name, "routing": {"kind": "topk"}}},
            "parallel": {"dispatch_unit": Executor.name}}
    [record] = plugins_lib.used(tree)
    assert record["module"] == __name__
    assert [(i["registry"], i["name"], i["field"]) for i in record["ideas"]] == [
        ("layer kind", Kind.name, "model.moe.kind"),
        ("executor", Executor.name, "parallel.dispatch_unit")]
  finally:
    LAYERS.unregister(Kind.name)
    EXECUTORS.unregister(Executor.name)
