"""A directory a binary cannot write is one ``error:`` line before any output (the pre-flight).

The check tries to create a directory (moejax.train.writable) instead of
reading permission bits: root passes ``os.access`` on ``/sys`` and
``/proc``, where mkdir fails (EPERM, ENOENT), and on a read-only mount's
parent. The binaries are run with ``HOME`` set to a fresh directory, so the
fix's example path is known.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile

import pytest

from experiments import cli
from moejax.train import checkpoint as ckpt_lib
from moejax.train import writable
from tests.ablation import helpers as ablation_helpers

ROOT = ablation_helpers.ROOT
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _refusal(parent: str, code: int, strerror: str) -> str:
  # As root the directory is tried (mkdir's errno); as a user, its permission bits refuse it.
  if IS_ROOT:
    return f"{parent} refuses new directories ({errno.errorcode[code]}: {strerror})"
  return f"{parent} is not writable"


def test_a_writable_path_and_its_missing_parents_pass_and_leave_nothing(tmp_path):
  assert writable.problem(str(tmp_path / "a" / "b")) is None
  assert writable.problem(str(tmp_path)) is None
  assert os.listdir(tmp_path) == []  # the probe directory is gone


def test_a_file_in_the_way_is_named(tmp_path):
  blocker = tmp_path / "f"
  blocker.write_text("")
  assert writable.problem(str(blocker / "run")) == f"{blocker} is a file, not a directory"


def test_a_read_only_filesystem_is_found_by_trying(tmp_path, monkeypatch):
  def refuse(**kwargs):
    raise OSError(errno.EROFS, "Read-only file system")
  monkeypatch.setattr(tempfile, "mkdtemp", refuse)
  assert writable.problem(str(tmp_path / "run")) == (
      f"{tmp_path} refuses new directories (EROFS: Read-only file system)")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="Linux sysfs only")
def test_sysfs_and_procfs_are_refused_even_for_root():
  assert writable.problem("/sys/moejax_wd") == _refusal("/sys", errno.EPERM,
                                                        "Operation not permitted")
  assert writable.problem("/proc/moejax_wd") == _refusal("/proc", errno.ENOENT,
                                                         "No such file or directory")


def test_the_fix_names_a_path_under_home_that_can_be_written(tmp_path, monkeypatch):
  home = tmp_path / "home"
  home.mkdir()
  monkeypatch.setenv("HOME", str(home))
  blocker = tmp_path / "f"
  blocker.write_text("")
  with pytest.raises(ckpt_lib.WorkdirError) as e:
    ckpt_lib.check_writable(str(blocker / "wd"), "--workdir")
  assert str(e.value) == (f"--workdir={blocker}/wd cannot be created or written: {blocker} is a "
                          f"file, not a directory. Fix: pass a path in a writable directory, "
                          f"e.g. --workdir={home}/wd")


def test_an_unwritable_workdir_is_one_line_and_no_stopped_run(tmp_path, monkeypatch, capsys):
  """``train`` on an unwritable workdir: no run started, so none "stopped"."""
  home = tmp_path / "home"
  home.mkdir()
  monkeypatch.setenv("HOME", str(home))
  ro = tmp_path / "ro"
  ro.mkdir()
  real = tempfile.mkdtemp

  def read_only_below_ro(**kwargs):
    if str(kwargs.get("dir", "")).startswith(str(ro)):
      raise OSError(errno.EROFS, "Read-only file system")
    return real(**kwargs)
  monkeypatch.setattr(tempfile, "mkdtemp", read_only_below_ro)
  with pytest.raises(SystemExit) as exit_:
    cli.check_writable("--workdir", str(ro / "run"))
  assert exit_.value.code == 1
  out = capsys.readouterr()
  assert out.out == ""
  assert out.err.splitlines() == [
      f"error: WorkdirError: --workdir={ro}/run cannot be created or written: {ro} refuses new "
      f"directories (EROFS: Read-only file system). Fix: pass a path in a writable directory, "
      f"e.g. --workdir={home}/run"]
  assert "stopped" not in out.err and not os.path.exists(ro / "run")


def test_a_file_flag_names_its_value_and_its_missing_directories_are_made(tmp_path, monkeypatch,
                                                                           capsys):
  """``--json_out`` and the like: the file's directory is tried; a directory is not a file."""
  home = tmp_path / "home"
  home.mkdir()
  monkeypatch.setenv("HOME", str(home))
  blocker = tmp_path / "f"
  blocker.write_text("")
  for path, line in [
      (blocker / "out.json", f"--json_out={blocker}/out.json cannot be created or written: "
       f"{blocker} is a file, not a directory. Fix: pass a path in a writable directory, "
       f"e.g. --json_out={home}/out.json"),
      (home, f"--json_out={home} is a directory, not a file. Fix: name a file in it, "
       f"e.g. --json_out={home}/results.json")]:
    with pytest.raises(SystemExit) as exit_:
      cli.check_writable_file("--json_out", str(path))
    assert exit_.value.code == 1
    assert capsys.readouterr().err.splitlines() == [f"error: WorkdirError: {line}"]
  deep = tmp_path / "a" / "b" / "out.json"
  cli.check_writable_file("--json_out", str(deep))  # passes, and creates nothing
  assert not (tmp_path / "a").exists()
  assert cli.file_to_write(str(deep)) == str(deep) and (tmp_path / "a" / "b").is_dir()


def _run(tmp_path, binary: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", HOME=str(tmp_path))
  return subprocess.run([sys.executable, "-m", f"experiments.{binary}", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="Linux sysfs only")
@pytest.mark.parametrize("binary, args, flag, path, parent, code, strerror", [
    ("ablate", ["--config=configs/ablations/quick.py"], "--workdir", "/sys/moejax_wd", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("train", ["--config=configs/tiny.py"], "--workdir", "/proc/moejax_wd", "/proc",
     errno.ENOENT, "No such file or directory"),
    ("train", ["--config=configs/tiny.py", "--dry_run"], "--workdir", "/sys/moejax_wd", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("finetune", ["--source=/nonexistent_run"], "--workdir", "/sys/moejax_wd", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("export_hf", ["--workdir=/nonexistent_run"], "--out", "/sys/moejax_out", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("analyze_routing", ["--model_type=mixtral"], "--out_dir", "/sys/moejax_routing", "/sys",
     errno.EPERM, "Operation not permitted"),
    # The binaries that write one file: its directory is tried, the file's name is the fix's.
    ("bench", ["--suite=layer"], "--json_out", "/sys/moejax_layer.json", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("bench", ["--suite=serving"], "--serving_plot", "/sys/moejax_serving.png", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("bench", ["--suite=profile"], "--profile_trace_dir", "/sys/moejax_trace", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("quantize", ["--workdir=/nonexistent_run"], "--json_out", "/sys/moejax_q.json", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("compare", ["/nonexistent_suite"], "--csv", "/sys/moejax.csv", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("report", ["--out={home}/R.md"], "--results_dir", "/sys/moejax_results", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("report", [], "--out", "/proc/moejax_report.md", "/proc",
     errno.ENOENT, "No such file or directory"),
    ("device_check", ["--dry_run"], "--json_out", "/sys/moejax_dc.json", "/sys",
     errno.EPERM, "Operation not permitted"),
    ("routing_consistency", ["--workdir=/nonexistent_run"], "--json_out", "/sys/moejax_rc.json",
     "/sys", errno.EPERM, "Operation not permitted"),
])
def test_each_writing_binary_refuses_before_any_output(tmp_path, binary, args, flag, path,
                                                       parent, code, strerror):
  args = [a.format(home=tmp_path) for a in args]  # a path that must not be written: the test's
  proc = _run(tmp_path, binary, *args, f"{flag}={path}")
  assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])
  name = os.path.basename(path)
  assert proc.stderr.splitlines() == [
      f"error: WorkdirError: {flag}={path} cannot be created or written: "
      f"{_refusal(parent, code, strerror)}. Fix: pass a path in a writable directory, "
      f"e.g. {flag}={tmp_path}/{name}"]


def test_quantize_on_a_directory_without_a_run_is_one_line(tmp_path):
  proc = _run(tmp_path, "quantize", f"--workdir={tmp_path}/nothing")
  assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-2000:]
  assert proc.stderr.splitlines() == [
      f"error: WorkdirError: {tmp_path}/nothing has no config.json: not a moejax run directory. "
      "Fix: pass the --workdir of experiments.train (or a suite run directory "
      "DIR/<arm>[/seed_<s>])"]
