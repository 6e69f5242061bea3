"""A config file whose import fails (a plugin module off PYTHONPATH) is one ``error:`` line.

The line names the module and a fix that works: the folder to put on
PYTHONPATH (the config file's own folder when the module sits there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from experiments import cli
from tests.ablation import helpers as ablation_helpers

ROOT = ablation_helpers.ROOT
CONFIG = """import my_plugin_rules  # registers what the config names
from moejax.config import files

def get_config():
  return files.load_config_file({tiny!r})
"""


def _config(folder):
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / "exp.py"
  path.write_text(CONFIG.format(tiny=os.path.join(ROOT, "configs", "tiny.py")))
  return path


def _parse_error(capsys, config) -> str:
  argv = ["binary", f"--config={config}"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, sys_argv=argv)
  with pytest.raises(SystemExit) as exit_:
    cli.parse_flags(argv, experiment_at="", flag_values=fv)
  assert exit_.value.code == 1
  err = capsys.readouterr().err
  assert "Traceback" not in err and len(err.splitlines()) == 1, err
  return err.splitlines()[0]


def test_a_missing_plugin_module_is_one_line_naming_it_and_pythonpath(tmp_path, capsys):
  config = _config(tmp_path / "cfg")
  line = _parse_error(capsys, config)
  assert line == (
      f"error: --config={config}: cannot load it: it imports the module 'my_plugin_rules', "
      "which is not importable (neither on PYTHONPATH nor installed). Fix: put the folder that "
      "holds my_plugin_rules.py (or the package my_plugin_rules/) on PYTHONPATH "
      "(PYTHONPATH=DIR python -m ...), or pip install it; a plugin module must be importable "
      "wherever the config is loaded")
  # The module next to the config file: the line names that folder.
  (tmp_path / "cfg" / "my_plugin_rules.py").write_text("VALUE = 1\n")
  line = _parse_error(capsys, config)
  assert f"Fix: it sits in {tmp_path / 'cfg'}: run with PYTHONPATH={tmp_path / 'cfg'};" in line


def test_another_import_error_is_one_line_too(tmp_path, capsys):
  config = _config(tmp_path / "cfg")
  (tmp_path / "cfg" / "my_plugin_rules.py").write_text("from json import no_such_name\n")
  sys.path.insert(0, str(tmp_path / "cfg"))
  try:
    line = _parse_error(capsys, config)
  finally:
    sys.path.remove(str(tmp_path / "cfg"))
    sys.modules.pop("my_plugin_rules", None)
  assert line.startswith(f"error: --config={config}: cannot load it: ImportError: cannot "
                         "import name 'no_such_name' from 'json'"), line
  assert line.endswith("Fix: correct that import in the config file or in the module it "
                       "imports")


def test_the_train_binary_says_it_in_one_line_and_the_fix_works(tmp_path):
  config = _config(tmp_path / "cfg")
  (tmp_path / "cfg" / "my_plugin_rules.py").write_text("VALUE = 1\n")
  work = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  run = lambda extra: subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config={config}", f"--workdir={work}",
       "--print_config"], cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu", **extra),
      capture_output=True, text=True, timeout=300)
  out = run({})
  assert out.returncode == 1
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and "my_plugin_rules" in lines[0]
  assert not work.exists()
  fixed = run({"PYTHONPATH": str(tmp_path / "cfg")})  # the fix the line names
  assert fixed.returncode == 0, fixed.stderr[-2000:]
  assert '"d_model": 32' in fixed.stdout
