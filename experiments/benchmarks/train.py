r"""Training runs (``--suite=train``): what the main job costs and what it reaches.

Usage:
  python -m experiments.bench --suite=train --json_out=results/bench/train.json
  python -m experiments.bench --suite=train --train_configs=default \
      --train_args=--config.train.steps=50

Runs ``python -m experiments.train --config=configs/NAME.py`` for each of
``--train_configs`` (default: the README's default MoE, its dense twin and
the BPE default), one after the other in a fresh process each, and records
per run:

* what it costs: wall time, user and system CPU seconds and peak RSS of the
  training process (``os.wait4``: the same numbers ``/usr/bin/time -v``
  prints), and the size of its workdir at the end;
* what it reaches, from its own ``metrics.jsonl``: the last training loss
  (the mean of its last log interval), the final whole-split evaluation
  (loss per token and per byte, bytes per token, MaxVio_global,
  specialisation MI) and the unigram baseline; parameters from the model's
  accounting (moejax.topology.accounting);
* the first and last lines it printed, so a reader sees what the command
  shows.

After the first run, the checkpoint checksums (moejax.train.integrity) are
timed on that config's freshly initialised state (``--repeats``, median):
their cost is paid once per save and once per restore.

Timings move with the machine and its load (``conditions`` records the load
average); losses move in their last digits with the CPU's instruction set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments.benchmarks import common
from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry

_CONFIGS = flags.DEFINE_list("train_configs", ["default", "dense", "default_bpe"],
                             "--suite=train: configs/NAME.py files (or paths) to train")
_ARGS = flags.DEFINE_list("train_args", [], "--suite=train: flags added to every training "
                          "command (e.g. --config.train.steps=50)")
_WORKDIR = flags.DEFINE_string("train_workdir", None, "--suite=train: keep the runs under "
                               "this directory (default: a temporary one, removed after)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCERPT_HEAD = 3
EXCERPT_KEEP = ("eval step", "done:")  # the lines of the excerpt after its head


def config_path(name: str) -> str:
  """configs/NAME.py for a bare name, else the path as given."""
  return name if name.endswith(".py") else os.path.join("configs", f"{name}.py")


def timed_process(cmd: list[str], log_path: str, env: dict | None = None) -> dict:
  """Runs ``cmd`` (stdout and stderr to ``log_path``; ``env``: its environment, default
  this process's); its exit status, wall seconds and the resource usage of that one
  process tree (``os.wait4``)."""
  t0 = time.perf_counter()
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  return {"exit": proc.returncode, "wall_s": time.perf_counter() - t0,
          "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
          # Linux reports ru_maxrss in KiB.
          "peak_rss_mb": usage.ru_maxrss * 1024 / 1e6}


def dir_mb(path: str) -> float:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
             for f in fs if not os.path.islink(os.path.join(d, f))) / 1e6


def reached(workdir: str) -> dict:
  """The run's last training loss, its final evaluation and its parameter count."""
  # pylint: disable=g-import-not-at-top
  from moejax.topology.accounting import budget
  from moejax.train.config import experiment_from_dict
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  train = [r for r in rows if r.get("split") == "train"]
  evals = [r for r in rows if r.get("split") == "eval"]
  if not train or not evals:
    raise bench_lib.BenchFailed(f"{workdir}/metrics.jsonl has no training or evaluation row")
  last = evals[-1]
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    exp = experiment_from_dict(json.load(f))
  return {"steps": last["step"], "train_loss": train[-1]["loss"], "val_loss": last["loss"],
         "val_loss_per_byte": last.get("loss_per_byte"),
         "bytes_per_token": last["bytes"] / last["tokens"] if last.get("bytes") else None,
         "max_vio_global": last.get("max_vio_global"),
         "specialisation_mi": last.get("specialisation_mi"),
         "unigram_baseline": last.get("unigram_baseline"),
         "vocab": exp.model.vocab_size,
         "params": budget(exp.model, seq_len=exp.data.seq_len).total}


def excerpt(log_path: str, workdir: str) -> list[str]:
  """The first lines the run printed, its evaluations and its last line (the workdir's
  temporary path shown as DIR)."""
  with open(log_path, encoding="utf-8", errors="replace") as f:
    lines = [line.rstrip("\n").replace(workdir, "DIR") for line in f if line.strip()]
  head = lines[:EXCERPT_HEAD]
  tail = [line for line in lines[EXCERPT_HEAD:] if line.startswith(EXCERPT_KEEP)]
  if tail:
    return head + ["..."] + tail
  rest = lines[EXCERPT_HEAD:]  # a run that failed: its last lines say why
  return head + (["..."] + rest[-EXCERPT_HEAD:] if len(rest) > EXCERPT_HEAD else rest)


def workdir_of(name: str, root: str) -> str:
  return os.path.join(root, os.path.basename(config_path(name))[:-3])


def one_run(name: str, root: str) -> dict:
  workdir = workdir_of(name, root)
  cmd = [sys.executable, "-m", "experiments.train", f"--config={config_path(name)}",
         f"--workdir={workdir}", *_ARGS.value]
  log = workdir + ".log"
  usage = timed_process(cmd, log)
  shown = " ".join(["python", *cmd[1:3], cmd[3], "--workdir=DIR", *_ARGS.value])
  row = {"command": shown, **usage, "excerpt": excerpt(log, workdir)}
  if usage["exit"] != 0:
    return {**row, "error": f"exit status {usage['exit']}: " + " | ".join(row["excerpt"][-2:])}
  row["workdir_mb"] = dir_mb(workdir)
  row.update(reached(workdir))
  bench_lib.progress(f"{name}: {usage['wall_s']:.0f}s wall, val loss {row['val_loss']:.4f}")
  return row


def checksum_cost(workdir: str) -> dict:
  """Median seconds of ``integrity.checksums`` on the initial training state of the run in
  ``workdir`` (its own config.json)."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from moejax.train import integrity, optim, step
  from moejax.train.config import experiment_from_dict
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    exp = experiment_from_dict(json.load(f))
  _, state = step.init_state(exp, optim.make_optimizer(exp.train, exp.model, exp.finetune))
  tree = state.checkpoint_tree()
  sums = integrity.checksums(tree)
  times = []
  for _ in range(common.repeats()):
    t0 = time.perf_counter()
    integrity.checksums(tree)
    times.append(time.perf_counter() - t0)
  mib = sum(int(np.prod(v["shape"])) * np.dtype(v["dtype"]).itemsize
            for v in sums.values() if "shape" in v) / 2**20
  return {"arrays": len(sums), "mib": mib, "median_s": float(np.median(times)),
          "repeats": len(times)}


def run() -> dict:
  conditions = bench_lib.conditions()
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="moejax_train_bench_")
  os.makedirs(root, exist_ok=True)
  try:
    runs = {}
    for name in _CONFIGS.value:
      runs[name] = one_run(name, root)
    out = {"runs": runs, "args": list(_ARGS.value)}
    first = _CONFIGS.value[0] if _CONFIGS.value else None
    if first and "error" not in runs[first]:
      out["checksums"] = {"config": first, **checksum_cost(workdir_of(first, root))}
  finally:
    if not _WORKDIR.value:
      shutil.rmtree(root, ignore_errors=True)
  return {**out, "conditions": conditions,
          "conditions_after": {"load_avg_1_5_15": list(os.getloadavg())}}


def min_s(s: float) -> str:
  whole = int(round(s))
  return f"{whole // 60}m{whole % 60:02d}s"


def _num(x, fmt: str) -> str:
  return "-" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
  """The runs' table, the first run's printed lines and the checksum cost."""
  lines = ["| run | vocab | params | steps | wall | CPU (user + sys) | peak RSS | workdir | "
           "train loss | val loss | val loss / byte | bytes / token | MaxVio_global | MI | "
           "unigram |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
           "---:|---:|"]
  for name, r in res["runs"].items():
    if "error" in r:
      lines.append(f"| `{name}` | failed: {r['error'][:100]} |" + " |" * 13)
      continue
    lines.append(
        f"| `{name}` | {r['vocab']} | {r['params'] / 1e6:.2f}M | {r['steps']} | "
        f"{min_s(r['wall_s'])} | {r['user_s'] + r['sys_s']:.0f} s | "
        f"{r['peak_rss_mb'] / 1e3:.2f} GB | {r['workdir_mb']:.0f} MB | {r['train_loss']:.4f} | "
        f"{r['val_loss']:.4f} | {_num(r['val_loss_per_byte'], '.4f')} | "
        f"{_num(r['bytes_per_token'], '.2f')} | {_num(r['max_vio_global'], '.3f')} | "
        f"{_num(r['specialisation_mi'], '.3f')} | {_num(r['unigram_baseline'], '.3f')} |")
  args = " ".join(res.get("args") or [])
  out = ["Each run: `python -m experiments.train --config=configs/NAME.py --workdir=DIR"
         + (f" {args}" if args else "") + "`, one seed, one after the other; val loss: the "
         "final evaluation on the whole validation split; train loss: the mean of the last "
         f"log interval; load average {_load(res)}.", "", *lines]
  first = next(iter(res["runs"].items()), None)
  if first and first[1].get("excerpt"):
    out += ["", f"What `{first[0]}` printed (its first lines, evaluations and last line):", "",
            "```",
            *first[1]["excerpt"], "```"]
  cs = res.get("checksums")
  if cs:
    out += ["", f"Checkpoint checksums of `{cs['config']}`'s training state ({cs['arrays']} "
            f"arrays, {cs['mib']:.1f} MiB): {1e3 * cs['median_s']:.0f} ms (median of "
            f"{cs['repeats']}), paid once per save and once per restore."]
  return "\n".join(out) + "\n"


def _load(res: dict) -> str:
  before = res["conditions"]["load_avg_1_5_15"][0]
  after = (res.get("conditions_after") or {}).get("load_avg_1_5_15", [None])[0]
  return f"{before:.1f} -> {after:.1f}" if after is not None else f"{before:.1f}"


def show(res: dict) -> None:
  print(markdown(res))


SUITE = registry.register(registry.Suite(
    "train", "training runs of configs/*.py: cost (wall, CPU, peak RSS, disk) and the losses "
    "they reach", run, show, outputs=(("train_workdir", "dir"),)))
