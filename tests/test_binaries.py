"""The binaries from the outside: one ``error:`` line per mistake, discovery flags, quiet logs.

Each test runs ``python -m experiments.<binary>`` as a user would (stdout and
stderr are pipes, not a terminal) and checks what comes back: a bad
invocation gives exit status 1 and exactly one ``error:`` line on stderr
(no traceback), before anything is written.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from moejax import data as data_lib
from moejax.ablation import suite as suite_lib
from moejax.train import loop, writable
from tests.ablation import helpers as ablation_helpers
from tests.train import helpers

ROOT = helpers.ROOT


def _run(binary: str, *args: str, env=None, timeout=300) -> subprocess.CompletedProcess:
  env = dict(os.environ if env is None else env, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", f"experiments.{binary}", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
  """A data dir holding configs/tiny.py's corpus."""
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  data_lib.load_documents(helpers.experiment("tiny", data_dir).data, "train")
  return data_dir


@pytest.mark.parametrize("binary, config, override, hint", [
    ("train", "configs/tiny.py", "--config.train.stepz=3", 'did you mean "steps"?'),
    ("train", "configs/tiny.py", "--config.model.moe.routing.top_kk=1", 'did you mean "top_k"?'),
    ("ablate", "configs/ablations/quick.py", "--config.base.train.stepz=3",
     'did you mean "steps"?'),
    ("train", "configs/tiny.py", "--config.model.moe.num_experts=8",
     "moved to model.moe.topology.num_experts"),
])
def test_misspelt_override_key_is_one_line_with_the_hint(tmp_path, binary, config, override,
                                                          hint):
  workdir = str(tmp_path / "run")
  line = _one_error_line(_run(binary, f"--config={config}", f"--workdir={workdir}", override))
  key = override.split("=")[0]
  assert line == (f"error: {key}: {key.rsplit('.', 1)[1]!r} is not a config field; {hint} "
                  "(--print_config lists every field with its default)")
  assert not os.path.exists(workdir)


@pytest.mark.parametrize("binary", ["train", "ablate"])
def test_missing_or_broken_config_file_is_one_line(tmp_path, binary):
  workdir = str(tmp_path / "run")
  missing = _one_error_line(_run(binary, "--config=configs/nope.py", f"--workdir={workdir}"))
  assert missing == ("error: --config=configs/nope.py: no such file. Fix: the config files in "
                     "configs/ are " + ", ".join(sorted(
                         n for n in os.listdir(os.path.join(ROOT, "configs"))
                         if n.endswith(".py"))) + " (more in configs/ablations/, configs/presets/)")
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(:\n")
  line = _one_error_line(_run(binary, f"--config={broken}", f"--workdir={workdir}"))
  assert line == f"error: --config={broken}: cannot load it: SyntaxError: invalid syntax (line 1)"
  raising = tmp_path / "raising.py"
  raising.write_text("def get_config():\n  raise ValueError('no such preset')\n")
  line = _one_error_line(_run(binary, f"--config={raising}", f"--workdir={workdir}"))
  assert line == f"error: --config={raising}: cannot load it: ValueError: no such preset"
  assert not os.path.exists(workdir)


def test_uncreatable_workdir_and_data_dir_are_one_line(tmp_path, prepared):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  line = _one_error_line(_run("train", "--config=configs/tiny.py",
                              f"--workdir={blocker}/run", f"--config.data.data_dir={prepared}"))
  assert line == (f"error: WorkdirError: --workdir={blocker}/run cannot be created or written: "
                  f"{blocker} is a file, not a directory. Fix: pass a path in a writable "
                  f"directory, e.g. --workdir={writable.writable_example(f'{blocker}/run')}")
  line = _one_error_line(_run("ablate", "--config=configs/ablations/quick.py",
                              f"--workdir={blocker}/suite"))
  assert f"--workdir={blocker}/suite cannot be created or written" in line
  workdir = str(tmp_path / "run")
  line = _one_error_line(_run("train", "--config=configs/tiny.py", f"--workdir={workdir}",
                              f"--config.data.data_dir={blocker}/tfds"))
  assert line.startswith(f"error: DatasetUnavailableError: cannot prepare python_stdlib in "
                         f"data_dir={blocker}/tfds (NotADirectoryError")
  assert line.endswith("Fix: pass a writable --config.data.data_dir")
  assert not os.path.exists(workdir)


def test_truncated_dataset_shard_is_one_line(tmp_path, prepared):
  data_dir = str(tmp_path / "tfds")
  shutil.copytree(prepared, data_dir)
  shard = next(os.path.join(d, f) for d, _, fs in os.walk(data_dir) for f in fs
               if "train.array_record" in f)
  with open(shard, "r+b") as f:
    f.truncate(5000)
  workdir = str(tmp_path / "run")
  line = _one_error_line(_run("train", "--config=configs/tiny.py", f"--workdir={workdir}",
                              f"--config.data.data_dir={data_dir}"))
  assert re.match(r"error: DatasetUnavailableError: python_stdlib/train: document 0 cannot be "
                  r"read from .*\(RuntimeError: .*\); the prepared files are damaged \(a "
                  r"truncated shard\?\)\. Fix: delete ", line), line
  assert not os.path.exists(workdir)


def test_pallas_backend_on_cpu_is_refused_before_the_workdir_then_blocked_runs(tmp_path,
                                                                               prepared):
  workdir = str(tmp_path / "run")
  line = _one_error_line(_run("train", "--config=configs/tiny.py", f"--workdir={workdir}",
                              f"--config.data.data_dir={prepared}",
                              "--config.model.moe.execution.backend=pallas_tpu"))
  assert line.startswith("error: ConfigError: model.moe.execution.backend='pallas_tpu': needs a TPU")
  assert "set model.moe.execution.interpret=True" in line
  assert not os.path.exists(workdir)
  cfg = helpers.experiment("tiny", prepared, model__moe__execution__backend="blocked", train__steps=2,
                           train__warmup_steps=1, train__eval_every=0)
  assert loop.train(cfg, workdir, out=io.StringIO())["step"] == 2


def test_print_config_shows_every_field_and_dry_run_writes_nothing(tmp_path, prepared):
  shown = _run("train", "--config=configs/tiny.py", "--print_config",
               "--config.train.steps=7", "--config.model.moe.execution.backend=auto")
  assert shown.returncode == 0, shown.stderr[-2000:]
  tree = json.loads(shown.stdout)
  assert tree["train"]["steps"] == 7 and tree["train"]["nan_at_step"] == -1  # a default
  # The backend that runs, and that 'auto' chose it on this platform.
  assert tree["model"]["moe"]["execution"] == {
      "backend": "blocked", "interpret": False, "derived_from": "auto on cpu",
      "executor": "grouped", "large_group_backend": "", "large_group_rows": 0}
  assert set(tree) == {"model", "data", "train", "parallel", "finetune"}
  assert tree["finetune"]["source"] == ""  # a training run is no fine-tune unless told
  assert tree["model"]["moe"]["routing"]["top_k"] == 2
  # Knobs are printed resolved: the numbers that run, and what produced them.
  fine = _run("train", "--config=configs/tiny.py", "--print_config",
              "--config.model.moe.topology.granularity=2")
  assert fine.returncode == 0, fine.stderr[-2000:]
  topo = json.loads(fine.stdout)["model"]["moe"]["topology"]
  assert (topo["num_experts"], topo["expert_width"], topo["granularity"]) == (8, 16, 1)
  assert json.loads(fine.stdout)["model"]["moe"]["routing"]["top_k"] == 4
  assert topo["derived_from"].startswith("granularity=2")
  twin = _run("train", "--config=configs/tiny.py", "--print_config",
              "--config.model.dense_twin=active")
  model = json.loads(twin.stdout)["model"]
  assert model["moe"] is None and model["dense_ff_width"] == 2 * 32
  before = helpers.snapshot(prepared)
  workdir = str(tmp_path / "run")
  dry = _run("train", "--config=configs/tiny.py", f"--workdir={workdir}", "--dry_run",
             f"--config.data.data_dir={prepared}")
  assert dry.returncode == 0, dry.stderr[-2000:]
  assert "47.52K" in dry.stdout and "flops_per_token" in dry.stdout  # the budget table
  assert f"workdir {workdir}: new run" in dry.stdout and f"prepared in {prepared}" in dry.stdout
  assert not os.path.exists(workdir) and helpers.snapshot(prepared) == before


def test_ablate_print_config_and_dry_run(tmp_path):
  shown = _run("ablate", "--config=configs/ablations/quick.py", "--print_config",
               "--config.scale=m")
  assert shown.returncode == 0, shown.stderr[-2000:]
  tree = json.loads(shown.stdout)
  assert tree["name"] == "quick" and tree["base"]["train"]["nan_at_step"] == -1
  assert tree["scale"] == "m" and tree["base"]["model"]["d_model"] == 2 * 128  # the rung's
  arms = tree["arms (changes to base: field -> value)"]
  assert len(arms) == 2 and all(arms.values())
  # A finished one-seed run of the first arm elsewhere (seeds run as separate processes).
  suite = suite_lib.suite_from_dict(helpers.config_file("ablations/quick"))
  (first, seed, first_rel), (_, _, second_rel) = list(suite.runs())[:2]
  src = tmp_path / "seed_run" / first.name
  ablation_helpers.write_finished_run(str(src), first.experiment, seed)
  workdir = str(tmp_path / "suite")
  dry = _run("ablate", "--config=configs/ablations/quick.py", f"--workdir={workdir}",
             "--dry_run", f"--import_runs={tmp_path / 'seed_run'}")
  assert dry.returncode == 0, dry.stderr[-2000:]
  assert f"  {first_rel}: finished in {src} (would be imported)" in dry.stdout
  assert f"  {second_rel}: new" in dry.stdout and set(arms) == {first_rel, second_rel}
  assert "nothing was written" in dry.stdout and not os.path.exists(workdir)


def test_analyze_routing_without_the_interop_extra_says_which_to_install(tmp_path):
  # All three packages of the extra are hidden, so the line is the same whether or not
  # the extra is installed here (CI installs it; a plain ".[test]" install has none).
  hidden = tmp_path / "no_interop"
  for name in ("torch", "transformers", "safetensors"):
    (hidden / name).mkdir(parents=True)
    (hidden / name / "__init__.py").write_text(
        f"raise ImportError(\"No module named '{name}'\")\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(hidden), ROOT, os.environ.get("PYTHONPATH", "")]))
  line = _one_error_line(_run("analyze_routing", "--model_type=mixtral",
                              f"--out_dir={tmp_path / 'out'}", env=env))
  assert line == ("error: analyze_routing needs the interop extra (torch, transformers, "
                  'safetensors not installed). Fix: pip install -e ".[interop]"')
  # Routing given hidden states needs safetensors only: the line names only that one.
  line = _one_error_line(_run("analyze_routing", "--model_type=mixtral",
                              f"--hidden_states={tmp_path / 'h.npy'}",
                              f"--out_dir={tmp_path / 'out'}", env=env))
  assert line == ("error: analyze_routing needs the interop extra (safetensors not installed). "
                  'Fix: pip install -e ".[interop]"')
  assert not (tmp_path / "out").exists()


def test_preparing_a_dataset_in_a_log_prints_one_plain_line(tmp_path, capfd):
  # Captured: stdout / stderr are not terminals, as in a log file.
  data_lib.load_documents(helpers.experiment("tiny", str(tmp_path)).data, "train")
  out, err = capfd.readouterr()
  assert "Downloading and preparing" not in out + err
  assert "\x1b[" not in out + err and "\r" not in out + err
  assert re.fullmatch(r"prepared python_stdlib \(.*\) in \S+\n", out), out


def test_ablate_caches_compiled_programs_in_the_suite_directory(tmp_path, monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import cli  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert cli.compilation_cache(str(tmp_path)) == str(tmp_path / "compile_cache")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "compile_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert cli.compilation_cache(str(tmp_path)) == str(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)

