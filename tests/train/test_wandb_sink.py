"""The optional Weights & Biases writer: the names TensorBoard gets, resume, a clear error."""

import io
import os
import sys
import types

import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.train import metrics_log, wandb_sink
from tests.train import helpers


class _FakeRun:
  def __init__(self, calls):
    self.calls = calls

  def log(self, values, step):
    self.calls.append(("log", step, values))

  def finish(self):
    self.calls.append(("finish",))


def _fake_wandb(calls):
  mod = types.ModuleType("wandb")

  def init(**kwargs):
    calls.append(("init", kwargs))
    return _FakeRun(calls)

  mod.init = init
  mod.Settings = lambda **kw: kw
  mod.Histogram = lambda values: ("histogram", list(np.asarray(values)))
  return mod


def test_wandb_gets_the_tensorboard_names_and_the_config(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
  cfg = helpers.experiment("tiny", train__wandb_project="moe-study")
  writer = metrics_log.MetricsWriter.for_run(cfg, str(tmp_path), 0, True)
  writer.write(10, "train", {"loss": 2.5, "peak_source": "table", "balance/aux_loss": 0.01})
  writer.histograms(10, "train", {"load/layer_0": [0.5, 0.25, 0.25]})
  writer.close()
  (_, init), *rest = calls
  assert init["project"] == "moe-study" and init["mode"] == "offline"
  assert init["dir"] == str(tmp_path) and init["resume"] == "allow"
  assert init["config"]["train"]["wandb_project"] == "moe-study"
  assert init["config"]["model"]["moe"]["routing"]["kind"] == cfg.model.moe.routing.kind
  assert rest == [("log", 10, {"train/loss": 2.5, "train/balance/aux_loss": 0.01}),
                  ("log", 10, {"train/load/layer_0": ("histogram", [0.5, 0.25, 0.25])}),
                  ("finish",)]
  assert metrics_log.read_metrics(str(tmp_path))[0]["peak_source"] == "table"  # JSONL only


def test_a_resumed_run_appends_to_the_same_wandb_run(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
  cfg = helpers.experiment("tiny", train__wandb_project="p", train__wandb_mode="online")
  for resume in (0, 10):
    metrics_log.MetricsWriter.for_run(cfg, str(tmp_path), resume, True).close()
  ids = [c[1]["id"] for c in calls if c[0] == "init"]
  assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 12
  assert [c[1]["mode"] for c in calls if c[0] == "init"] == ["online", "online"]


def test_no_project_no_wandb_and_only_process_0_writes(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
  metrics_log.MetricsWriter.for_run(helpers.experiment("tiny"), str(tmp_path), 0, True).close()
  cfg = helpers.experiment("tiny", train__wandb_project="p")
  metrics_log.MetricsWriter.for_run(cfg, str(tmp_path / "w1"), 0, False).close()
  assert calls == []
  assert not os.path.exists(tmp_path / wandb_sink.RUN_ID_FILE)


def test_a_project_without_wandb_installed_is_one_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
  cfg = helpers.experiment("tiny", train__wandb_project="p")
  with pytest.raises(ConfigError, match=r"train\.wandb_project.*not installed.*\[wandb\]"):
    metrics_log.MetricsWriter.for_run(cfg, str(tmp_path), 0, True)


def test_wandb_mode_is_checked():
  with pytest.raises(ConfigError, match=r"train\.wandb_mode.*'cloud'"):
    helpers.experiment("tiny", train__wandb_mode="cloud")


def test_a_training_run_writes_an_offline_wandb_run(tmp_path, monkeypatch, data_dir):
  pytest.importorskip("wandb", reason="the wandb extra is not installed")
  for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(var, str(tmp_path / var.lower()))
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  cfg = helpers.experiment("tiny", data_dir, train__steps=4, train__log_every=2,
                           train__warmup_steps=1, train__eval_every=0,
                           train__wandb_project="moejax-test")
  work = tmp_path / "run"
  loop.train(cfg, str(work), out=io.StringIO())
  runs = [d for d in os.listdir(work / "wandb") if d.startswith("offline-run-")]
  assert len(runs) == 1, os.listdir(work / "wandb")
  files = os.listdir(work / "wandb" / runs[0])
  data = [f for f in files if f.endswith(".wandb")]
  assert data and os.path.getsize(work / "wandb" / runs[0] / data[0]) > 0
  rid = (work / wandb_sink.RUN_ID_FILE).read_text().strip()
  assert data[0] == f"run-{rid}.wandb"
