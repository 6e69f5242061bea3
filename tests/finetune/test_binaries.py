"""experiments.finetune and experiments.export_hf from the outside: one error line per mistake,
the accounting table, the dry run and printed config, and (slow) HF Mixtral -> fine-tune -> HF
Mixtral end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.train import helpers

ROOT = helpers.ROOT


def _run(binary, *args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", f"experiments.{binary}", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc) -> str:
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize("args, want", [
    (("--config.finetune.lora=('experts',)",),
     "error: ConfigError: finetune.lora_rank=0: LoRA adapters on ('experts',) need a rank"),
    pytest.param(("--config.finetune.lora_rnak=3",), '"lora_rank"', marks=pytest.mark.slow),
    pytest.param(("--config.finetune.freeze=('router', 'mod')",),
                 "error: ConfigError: finetune.freeze=('router', 'mod'): freezes the mod, but the "
                 "model has no mixture-of-depths block", marks=pytest.mark.slow),
])
def test_bad_options_are_one_error_line_before_any_write(source_run, tmp_path, args, want):
  _, source = source_run
  workdir = str(tmp_path / "ft")
  line = _one_error_line(_run("finetune", f"--source={source}", f"--workdir={workdir}", *args))
  assert want in line
  assert not os.path.exists(workdir)


def _lists_every_option(stdout):
  for option in ("full", "router frozen", "experts frozen", "LoRA attention+dense",
                 "LoRA experts", "this run"):
    assert f"\n{option} " in stdout
  assert "optimizer bytes are exact" in stdout


def _tiny(data_dir):
  """Overrides of configs/finetune.py for the tiny corpus and a 2-step run."""
  return ("--config.data.data_dir=" + data_dir, "--config.data.stdlib_max_files=12",
          "--config.data.stdlib_val_fraction=0.3", "--config.data.seq_len=32",
          "--config.data.batch_size=4", "--config.train.steps=2",
          "--config.train.warmup_steps=1", "--config.train.eval_every=0",
          "--config.train.eval_batches=1", "--config.train.checkpoint_every=0",
          "--config.train.log_every=1")


def test_accounting_with_a_workdir_prints_every_option_then_fine_tunes(source_run, tmp_path,
                                                                       ft_data_dir):
  """The README's line (--workdir and --accounting): before, --accounting printed the table
  and exited, so the workdir the next line exports was never written."""
  _, source = source_run
  workdir = str(tmp_path / "ft")
  proc = _run("finetune", f"--source={source}", f"--workdir={workdir}", "--accounting",
              *_tiny(ft_data_dir))
  assert proc.returncode == 0, proc.stderr[-3000:]
  _lists_every_option(proc.stdout)
  assert proc.stdout.index("LoRA experts, router trains") < proc.stdout.index("done: step 2")
  assert os.path.exists(os.path.join(workdir, "config.json"))
  assert os.listdir(os.path.join(workdir, "checkpoints"))
  # Its losses are the comment and docstring targets' only (configs/finetune.py), and it says so.
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("the train and val loss above cover only the comment, docstring "
                         "targets (data.loss_domains; the code, string tokens are context, not "
                         "scored); the unigram baseline beside them is over every token; val "
                         "loss of every domain at step 2: code "), last
  assert "| comment " in last and "string" in last.split("docstring")[-1]


@pytest.mark.slow  # the same table as above and the dry run's, below
def test_accounting_without_a_workdir_lists_every_option_and_writes_nothing(source_run):
  _, source = source_run
  proc = _run("finetune", f"--source={source}", "--accounting")
  assert proc.returncode == 0, proc.stderr[-3000:]
  _lists_every_option(proc.stdout)
  assert proc.stdout.strip().splitlines()[-1] == (
      "accounting only: nothing was trained or written (add --workdir=DIR to fine-tune after "
      "the table)")


def test_dry_run_and_print_config_read_the_source_and_write_nothing(source_run, tmp_path):
  src_cfg, source = source_run
  workdir = str(tmp_path / "ft")
  proc = _run("finetune", f"--source={source}", f"--workdir={workdir}", "--dry_run",
              "--config.finetune.freeze=('router',)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"workdir {workdir}: new run" in proc.stdout
  assert "source: " in proc.stdout and "dry run: the config is valid" in proc.stdout
  _lists_every_option(proc.stdout)
  shown = _run("finetune", f"--source={source}", "--print_config")
  assert shown.returncode == 0, shown.stderr[-3000:]
  tree = json.loads(shown.stdout)
  assert tree["finetune"]["source"] == source and tree["finetune"]["source_format"] == "moejax"
  assert tree["model"]["d_model"] == src_cfg.model.d_model   # the model is the source's
  assert tree["data"]["loss_domains"] == ["comment", "docstring"]  # configs/finetune.py
  assert not os.path.exists(workdir)


def test_export_of_a_model_mixtral_cannot_hold_is_one_error_line(source_run, tmp_path):
  _, source = source_run   # configs/tiny.py: sigmoid scores with a selection bias
  line = _one_error_line(_run("export_hf", f"--workdir={source}", f"--out={tmp_path / 'hf'}"))
  assert line.startswith("error: InteropError: mixtral cannot express this model: "
                         "model.moe.routing.score_fn='sigmoid' (mixtral: 'softmax'); "
                         "model.moe.routing.use_bias=True (mixtral: False). Its MoE blocks are "
                         "deepseek_v3 blocks"), line
  assert line.endswith("Fix: train a model with those fields as mixtral has them and export "
                       "that run (configs/default_mixtral.py is configs/default.py routed as "
                       "mixtral routes: softmax top-2, no selection bias)"), line
  assert not os.path.exists(tmp_path / "hf")


@pytest.mark.slow
def test_hf_mixtral_fine_tuned_with_lora_exports_back_to_transformers(tmp_path, ft_data_dir):
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  import moejax  # pylint: disable=g-import-not-at-top
  from moejax.interop import hf_models  # pylint: disable=g-import-not-at-top
  hf_dir, ft, out = (str(tmp_path / n) for n in ("hf", "ft", "out"))
  hf_models.tiny_model("mixtral", init_std=0.1).save_pretrained(hf_dir)
  data = ["--config.data.data_dir=" + ft_data_dir, "--config.data.stdlib_max_files=12",
          "--config.data.stdlib_val_fraction=0.3", "--config.data.seq_len=32",
          "--config.data.batch_size=4", "--config.train.steps=3", "--config.train.warmup_steps=1",
          "--config.train.eval_every=0", "--config.train.checkpoint_every=0",
          "--config.train.log_every=1"]
  proc = _run("finetune", f"--source={hf_dir}", f"--workdir={ft}", *data,
              "--config.finetune.freeze=('all',)",
              "--config.finetune.lora=('attention', 'experts')", "--config.finetune.lora_rank=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "initialised from Hugging Face model" in proc.stdout
  proc = _run("export_hf", f"--workdir={ft}", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  ids = np.random.default_rng(0).integers(0, 256, (2, 16))
  model, _ = moejax.load(ft)
  want, _ = model(ids)
  hf = AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    got = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)
