"""A router from outside the package (tests/plugins/cosine_router.py), end to end.

With nothing under moejax/ changed, the plugin router: has its own options in
the config (validated, refused for another kind), trains through
``experiments.train``, is re-imported when its run is read back elsewhere,
runs as an arm of a two-arm suite through ``experiments.ablate`` (budget
check, load metrics in the summary), and runs under ``ep_moe_layer`` on 8
simulated devices with the single-device layer's outputs and gradients.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from moejax import config as C
from moejax.config.registry import ROUTERS, RegistryError
from moejax.routing import RouterSpec, register
from tests import fast_compile
from tests.plugins import cosine_router  # noqa: F401  (registers the kinds)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(args, cwd=ROOT, env=None, timeout=600):
  env = dict(os.environ, **(env or {}))
  env.setdefault("JAX_PLATFORMS", "cpu")
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_the_plugin_registers_through_the_public_api_and_names_collide():
  assert "cosine" in ROUTERS and ROUTERS.plugins()["cosine"].endswith("cosine_router")
  assert "topk" not in ROUTERS.plugins()  # shipped ones register the same way, from moejax

  class Again(RouterSpec):
    name = "cosine"

  class Shadow(RouterSpec):
    name = "topk"

  for spec, owner in ((Again(), "cosine_router"), (Shadow(), "moejax.routing.topk")):
    with pytest.raises(RegistryError, match=f"already registered \\(by .*{owner}"):
      register(spec)
  with pytest.raises(TypeError, match="RouterSpec instance"):
    register(object())


def test_options_are_config_fields_validated_and_refused_for_another_kind():
  cfg = C.from_dict(C.MoEConfig, {"routing": {"kind": "cosine",
                                              "options": {"temperature": 0.5}}})
  assert cfg.routing.opts == cosine_router.CosineOptions(proj_dim=8, temperature=0.5)
  assert C.to_dict(cfg)["routing"]["options"] == {"proj_dim": 8, "temperature": 0.5}
  with pytest.raises(C.ConfigError, match=r"^moe\.routing\.options\.temperature=0: must be"):
    C.from_dict(C.MoEConfig, {"routing": {"kind": "cosine", "options": {"temperature": 0}}})
  with pytest.raises(C.ConfigError, match=r"options\.proj_dim=4: is an option of "
                                          r"routing\.kind='cosine'.*not of this kind"):
    C.from_dict(C.MoEConfig, {"routing": {"kind": "topk", "options": {"proj_dim": 4}}})
  # A kind's defaults left in the tree (a command-line switch of routing.kind) are not "set".
  topk = C.from_dict(C.MoEConfig, {"routing": {"kind": "topk", "options": {"proj_dim": 8}}})
  assert topk.routing.kind == "topk"


def test_the_accounting_counts_the_plugin_router_from_its_parameter_shapes():
  from moejax.topology import accounting
  cfg = C.from_dict(C.MoEConfig, {"topology": {"num_experts": 4},
                                  "routing": {"kind": "cosine", "options": {"proj_dim": 8}}})
  router = accounting.moe_components(cfg, 32, seq_len=16)["router"]
  assert router.total == 32 * 8 + 8 * 4  # proj [d, r] + experts [r, E], not d x E
  assert router.flops == 2.0 * router.total


def test_train_binary_trains_it_and_a_fresh_process_reads_the_run_back(tmp_path):
  work = tmp_path / "run"
  proc = _run(["-m", "experiments.train", f"--config={HERE / 'cosine_config.py'}",
               f"--workdir={work}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
  assert rows and rows[-1]["step"] == 6
  record = json.loads((work / "plugins.json").read_text())
  assert [(r["module"], pathlib.Path(r["file"]).name, r["ideas"]) for r in record] == [
      ("cosine_router", "cosine_router.py",
       [{"registry": "router", "name": "cosine", "field": "model.moe.routing.kind"}])]
  assert len(record[0]["sha256"]) == 64
  # A process that never imported the plugin (another directory) reads the run: the
  # recorded module is imported from its file before the config is built.
  code = ("import moejax; m, c = moejax.load(%r); r = c.model.moe.routing; "
          "print(r.kind, r.options.temperature)" % str(work))
  out = _run(["-c", code], cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-2:] == ["cosine", "0.1"]
  # A plugin that cannot be found fails in one line naming it.
  broken = tmp_path / "broken"
  shutil.copytree(work, broken)
  record[0].update(module="gone_router", file=str(tmp_path / "gone_router.py"))
  (broken / "plugins.json").write_text(json.dumps(record))
  out = _run(["-c", code.replace(str(work), str(broken))], cwd=tmp_path,
             env={"PYTHONPATH": str(ROOT)})
  assert out.returncode != 0
  assert "PluginError: plugin module 'gone_router' (which registers router 'cosine') cannot " \
         "be imported here" in out.stderr


def test_ablate_runs_it_as_an_arm_with_budget_and_load_metrics(tmp_path):
  work = tmp_path / "suite"
  proc = _run(["-m", "experiments.ablate", f"--config={HERE / 'cosine_suite.py'}",
               f"--workdir={work}"])
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "budget" in proc.stdout.lower()
  summary = json.loads((work / "summary.json").read_text())
  arms = summary["arms"]
  assert set(arms) == {"topk", "cosine"}
  # The budget counts the plugin router's own parameters: d r + r E instead of d E per layer.
  d, r, e, layers = 32, 8, 4, 2
  assert arms["cosine"]["budget"]["total"] - arms["topk"]["budget"]["total"] == (
      layers * (d * r + r * e - d * e))
  for arm in ("topk", "cosine"):  # the load metrics reach the summary
    for metric in ("max_vio_global", "max_vio_batch", "drop_rate", "active_experts_mean"):
      assert arms[arm]["metrics"][metric]["interval"]["mean"] is not None, (arm, metric)
  assert "cosine" in summary["comparisons"]  # verdicts against the baseline
  for arm in ("topk", "cosine"):  # each balance loss in the objective, under its name
    assert [k for k in arms[arm]["metrics"] if k.startswith("balance/")] == ["balance/aux_loss"]
  result = json.loads((work / "cosine" / "result.json").read_text())
  assert [p["module"] for p in result["provenance"]["plugins"]] == ["cosine_router"]
  # Each run records its own plugins; the summary lists them with the runs made with each.
  topk = json.loads((work / "topk" / "result.json").read_text())
  assert "plugins" not in topk["provenance"]
  assert [(p["module"], p["runs"]) for p in summary["provenance"]["plugins"]] == [
      ("cosine_router", [result["run"]])]
  assert summary["provenance"]["plugin_flags"] == []
  assert "- plugin `cosine_router` (router `cosine`): sha256 `" in (
      work / "summary.md").read_text()


def test_ep_moe_layer_runs_it_on_8_devices_like_one_device():
  proc = _run([str(HERE / "ep_child.py")],
              env={"JAX_NUM_CPU_DEVICES": "8",
                   "XLA_FLAGS": fast_compile.XLA_FLAGS})
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  assert "OK cosine" in proc.stdout


def test_a_parameter_the_accounting_does_not_know_is_refused_before_training(tmp_path):
  """cosine_scaled's init creates a logit scale its param_shapes does not declare."""
  work = tmp_path / "suite"
  proc = _run(["-m", "experiments.ablate", f"--config={HERE / 'cosine_suite.py'}:cosine_scaled",
               f"--workdir={work}"])
  assert proc.returncode != 0
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  # 2 MoE layers x E_r = 4 scales, nowhere in the analytic accounting.
  assert "budget audit: arm 'cosine': component 'router' has" in lines[0]
  assert "(+8)" in lines[0], lines[0]
  assert not work.exists()
