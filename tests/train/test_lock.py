"""One run per workdir: the lock file, its refusals, stale locks, and two real processes.

Stale locks: a dead process's on this host (no flock); another host's by its
heartbeat (the lock file's mtime) or with ``take_over`` (``--take_over_lock``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moejax.train import lock as lock_lib
from tests.train import helpers


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def _write_lock(workdir, **info):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, lock_lib.LOCK_FILE), "w") as f:
    json.dump(info, f)


def test_second_holder_is_refused_and_release_frees_the_workdir(tmp_path):
  workdir = str(tmp_path / "run")
  with lock_lib.WorkdirLock(workdir) as held:
    with open(held.path) as f:
      info = json.load(f)
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    # flock is per open file: a second lock in this very process conflicts too.
    with pytest.raises(lock_lib.WorkdirLockedError,
                       match=rf"in use by another run \(pid {os.getpid()} on host"):
      lock_lib.WorkdirLock(workdir).acquire()
    with pytest.raises(lock_lib.WorkdirLockedError, match="delete .*run.lock"):
      lock_lib.check_unlocked(workdir)
  assert not os.path.exists(os.path.join(workdir, lock_lib.LOCK_FILE))
  lock_lib.check_unlocked(workdir)
  with pytest.raises(RuntimeError, match="boom"):
    with lock_lib.WorkdirLock(workdir):
      raise RuntimeError("boom")
  lock_lib.WorkdirLock(workdir).acquire().release()  # released on the exception


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  workdir = str(tmp_path / "run")
  pid = _dead_pid()
  _write_lock(workdir, pid=pid, host=socket.gethostname(), started="earlier")
  lock_lib.check_unlocked(workdir)  # nobody holds it
  said = []
  with lock_lib.WorkdirLock(workdir, say=said.append) as held:
    with open(held.path) as f:
      assert json.load(f)["pid"] == os.getpid()
  assert said == [f"{workdir}: taking over the stale lock of pid {pid} on host "
                  f"{socket.gethostname()}, started earlier (no longer running)"]


def test_lock_of_another_host_is_not_taken_over(tmp_path):
  workdir = str(tmp_path / "run")
  _write_lock(workdir, pid=12345, host="other-host", started="earlier")
  for attempt in (lock_lib.check_unlocked, lambda w: lock_lib.WorkdirLock(w).acquire()):
    with pytest.raises(lock_lib.WorkdirLockedError, match="pid 12345 on host other-host"):
      attempt(workdir)


def _age_lock(workdir, seconds):
  old = time.time() - seconds
  os.utime(os.path.join(workdir, lock_lib.LOCK_FILE), (old, old))


def test_lock_of_another_host_with_a_stale_heartbeat_is_taken_over(tmp_path):
  workdir = str(tmp_path / "run")
  _write_lock(workdir, pid=12345, host="other-host", started="earlier")
  _age_lock(workdir, lock_lib.STALE_SECONDS + 60)  # 11 minutes without a heartbeat
  lock_lib.check_unlocked(workdir)
  said = []
  with lock_lib.WorkdirLock(workdir, say=said.append) as held:
    with open(held.path) as f:
      assert json.load(f)["pid"] == os.getpid()
  assert said == [f"{workdir}: taking over the stale lock of pid 12345 on host other-host, "
                  "started earlier (another host; heartbeat 660s ago, over the 10-minute limit)"]


def test_fresh_lock_of_another_host_is_refused_naming_the_holder_and_both_fixes(tmp_path):
  workdir = str(tmp_path / "run")
  _write_lock(workdir, pid=12345, host="other-host", started="earlier")
  _age_lock(workdir, 30)
  for attempt in (lock_lib.check_unlocked, lambda w: lock_lib.WorkdirLock(w).acquire()):
    with pytest.raises(lock_lib.WorkdirLockedError) as info:
      attempt(workdir)
    assert str(info.value) == (
        f"{workdir} is in use by another run (pid 12345 on host other-host, started earlier; "
        "heartbeat 30s ago): that host's processes are not visible here, and its heartbeat is "
        "fresh. Fix: if that run is known to be dead (a requeued job), pass --take_over_lock; "
        "or wait until its heartbeat is 10 minutes old (then the lock is taken over by "
        "itself); or use another --workdir")
  assert json.load(open(os.path.join(workdir, lock_lib.LOCK_FILE)))["pid"] == 12345  # untouched
  # --take_over_lock: taken over at once, the holder named.
  lock_lib.check_unlocked(workdir, take_over=True)
  said = []
  with lock_lib.WorkdirLock(workdir, say=said.append, take_over=True):
    pass
  assert said == [f"{workdir}: taking over the lock of pid 12345 on host other-host, started "
                  "earlier (heartbeat 30s ago), as --take_over_lock asks"]


def test_take_over_does_not_take_a_lock_held_by_a_live_process(tmp_path):
  workdir = str(tmp_path / "run")
  with lock_lib.WorkdirLock(workdir):
    with pytest.raises(lock_lib.WorkdirLockedError, match="in use by another run"):
      lock_lib.WorkdirLock(workdir, take_over=True).acquire()


def test_the_holder_refreshes_its_heartbeat_until_released(tmp_path, monkeypatch):
  monkeypatch.setattr(lock_lib, "HEARTBEAT_SECONDS", 0.02)
  workdir = str(tmp_path / "run")
  path = os.path.join(workdir, lock_lib.LOCK_FILE)
  with lock_lib.WorkdirLock(workdir) as held:
    _age_lock(workdir, 3600)
    deadline = time.time() + 10
    while time.time() - os.stat(path).st_mtime > 60 and time.time() < deadline:
      time.sleep(0.02)
    assert time.time() - os.stat(path).st_mtime < 60  # touched again
    beat = held._beat  # pylint: disable=protected-access
  assert not beat.is_alive() and not os.path.exists(path)


def _train(workdir, data_dir, *extra):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}", *extra]


def test_two_train_processes_on_one_workdir(tmp_path, data_dir, compilation_cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **compilation_cache)
  workdir = str(tmp_path / "run")
  # A: a long run, quiet, no checkpoint before it is killed.
  first = subprocess.Popen(
      _train(workdir, data_dir, "--config.train.steps=1000000", "--config.train.log_every=100000",
             "--config.train.eval_every=0", "--config.train.checkpoint_every=0",
             "--config.train.progress=False"),
      cwd=helpers.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    seen = []
    for line in first.stdout:  # training: past the lock, config.json written
      seen.append(line)
      if line.startswith("compiled and ran the first step"):
        break
    assert first.poll() is None, "".join(seen)
    with open(os.path.join(workdir, lock_lib.LOCK_FILE)) as f:
      assert json.load(f)["pid"] == first.pid
    config_before = open(os.path.join(workdir, "config.json")).read()
    # B: refused at once, one line, nothing touched.
    second = subprocess.run(_train(workdir, data_dir, "--config.train.steps=5"),
                            cwd=helpers.ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 1, second.stderr[-2000:]
    assert second.stderr.count("\n") == 1 and second.stderr.startswith(
        f"error: WorkdirLockedError: {workdir} is in use by another run (pid {first.pid} on host")
    assert open(os.path.join(workdir, "config.json")).read() == config_before
    assert first.poll() is None  # A is still training
  finally:
    first.kill()  # SIGKILL: no clean-up, the lock file stays behind
    first.wait(timeout=60)
  assert first.returncode == -signal.SIGKILL
  assert os.path.exists(os.path.join(workdir, lock_lib.LOCK_FILE))
  # C: takes the dead run's lock over (A wrote no checkpoint: C starts the run again).
  third = subprocess.run(_train(workdir, data_dir, "--config.train.steps=5",
                                "--config.train.warmup_steps=1"),
                         cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert third.returncode == 0, third.stderr[-3000:]
  assert f"taking over the stale lock of pid {first.pid}" in third.stdout
  assert "done: step 5" in third.stdout
  assert not os.path.exists(os.path.join(workdir, lock_lib.LOCK_FILE))
