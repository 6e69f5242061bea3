"""README.md's command blocks run top to bottom as written.

A new user copies the README's ``bash`` blocks line by line; each line's
inputs must exist because an earlier line made them. Two parts:

- the default run checks the chain's structure without running it (no
  subprocess, well under a second): every command is a binary of
  ``experiments/``, every ``--flag`` is one that binary defines, every config
  file exists, and every path a command reads (a fine-tune's ``--source``,
  an export's ``--workdir``, compare's directories, ...) is one an earlier
  command writes. Renaming a workdir in one line only, or dropping the line
  that makes it, fails here; so does a command the interop extra serves
  whose line does not say ``needs .[interop]``;
- ``-m slow`` runs every command in order, as written, with tiny overrides
  appended (:func:`tiny_args`: a few steps of a 1-layer model on 12 files
  for the training binaries, toy sizes for the benchmarks), ``/tmp/``
  rewritten into a temporary directory and the working directory a scratch
  copy of the files the commands read relative to it (configs/, RESULTS.md,
  results/); each must exit 0 and write its files. A command needing the
  interop extra skips, naming it, where the extra is absent (and so does a
  command reading what a skipped one writes).

``pip install`` and ``python -m pytest`` lines are not run (the test is one
of those tests).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TMP = "/tmp/"
INTEROP_NOTE = "needs .[interop]"
# The binaries whose lines need the interop extra, and the modules they import from it.
INTEROP = {"analyze_routing": ("torch", "transformers"), "export_hf": ("safetensors",)}
POSITIONAL = "<positional>"
# binary -> the flags naming a path the command reads (an earlier line's output).
READS = {
    "finetune": ("source",), "export_hf": ("workdir",), "generate": ("workdir",),
    "quantize": ("workdir",), "analyze_routing": ("checkpoint", "text_file", "hidden_states"),
    "compare": (POSITIONAL,), "report": (POSITIONAL,),
}
# binary -> {flag naming a path the command writes: what the slow run expects there
# ("" : the path itself is a file)}.
WRITES = {
    "ablate": {"workdir": ("summary.md", "summary.csv", "plots")},
    "train": {"workdir": ("config.json", "metrics.jsonl", "checkpoints")},
    "finetune": {"workdir": ("config.json", "metrics.jsonl", "checkpoints")},
    "export_hf": {"out": ("config.json", "model.safetensors", "moejax_export.json")},
    "bench": {"json_out": ("",), "serving_plot": ("",)},
    "analyze_routing": {"out_dir": ("summary.json", "trace.csv")},
    "report": {"out": ("",)},
    "quantize": {"json_out": ("",)},
}
_ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok"}


@dataclasses.dataclass(frozen=True)
class Command:
  """One command of a README block: ``python -m experiments.<binary> <args>``."""

  line: str                 # the README line it came from (continuations joined)
  argv: tuple               # the tokens as a shell splits them, comment dropped
  comment: str              # the line's ``# ...`` comment
  binary: Optional[str]     # experiments.<binary>, None for a line not run (pip, pytest)

  def parsed(self) -> tuple[dict, list]:
    """({flag: value (True for a bare boolean)}, positionals) of the binary's arguments."""
    kinds = binary_flags(self.binary)
    flags, positionals = {}, []
    args = list(self.argv[3:])
    while args:
      arg = args.pop(0)
      if not arg.startswith("--"):
        positionals.append(arg)
        continue
      name, eq, value = arg[2:].partition("=")
      if not eq:
        if kinds.get(name) == "bool" or name.startswith("no") and kinds.get(name[2:]) == "bool":
          value = True
        elif args and not args[0].startswith("--"):
          value = args.pop(0)
      flags[name] = value
    return flags, positionals


def _split_comment(line: str) -> tuple[str, str]:
  """(code, comment) of a shell line: the first ``#`` outside quotes after a blank."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i], line[i + 1:].strip()
  return line, ""


def parse_readme(text: str) -> list[Command]:
  """The commands of every ```bash block of ``text``, in order (``&&`` splits a line)."""
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      code, comment = _split_comment(line)
      tokens = shlex.split(code)
      while tokens:
        cut = tokens.index("&&") if "&&" in tokens else len(tokens)
        argv, tokens = tuple(tokens[:cut]), tokens[cut + 1:]
        binary = None
        if argv[:2] == ("python", "-m") and argv[2].startswith("experiments."):
          binary = argv[2].removeprefix("experiments.")
        commands.append(Command(line.strip(), argv, comment, binary))
  return commands


@functools.lru_cache(maxsize=None)
def binary_flags(binary: str) -> dict[str, str]:
  """{flag: kind} a binary defines: its module's ``DEFINE_*``, the shared flags it
  defines through ``common_flags.NAME()``, and those of the ``experiments`` modules it
  imports (every module of a package it imports from: bench's suites), plus absl's own."""
  out = {name: "absl" for name in _ABSL_FLAGS}
  shared = _defines("common_flags")
  seen, todo = set(), [binary]
  while todo:
    name = todo.pop()
    if name in seen or name == "common_flags":
      continue
    seen.add(name)
    out.update(_defines(name))
    src = _source(name)
    out.update({f: shared[f] for f in re.findall(r"\bcommon_flags\.(\w+)\(", src)
                if f in shared})
    todo += re.findall(r"^from experiments import (\w+)", src, re.M)
    for package in re.findall(r"^from experiments\.(\w+) import", src, re.M):
      folder = os.path.join(ROOT, "experiments", package)
      todo += ([f"{package}/{m[:-3]}" for m in sorted(os.listdir(folder)) if m.endswith(".py")]
               if os.path.isdir(folder) else [package])
  return out


def _source(module: str) -> str:
  path = os.path.join(ROOT, "experiments", f"{module}.py")
  if not os.path.exists(path):
    return ""
  with open(path, encoding="utf-8") as f:
    return f.read()


def _defines(module: str) -> dict[str, str]:
  """{flag: kind} of the ``DEFINE_*`` calls in ``experiments/<module>.py``."""
  return {flag: "bool" if kind in ("bool", "boolean") else kind
          # DEFINE_x("flag", ...), or common_flags' _shared(flags.DEFINE_x, "flag", ...)
          for kind, flag in re.findall(r"\bDEFINE_(\w+)(?:\(\s*|,\s*)\"(\w+)\"",
                                       _source(module))}


def _is_path_under_tmp(value) -> bool:
  return isinstance(value, str) and value.startswith(TMP)


def _read_paths(cmd: Command) -> list[str]:
  flags, positionals = cmd.parsed()
  out = []
  for flag in READS.get(cmd.binary, ()):
    if flag == POSITIONAL:
      out += [p.rpartition("=")[2] for p in positionals]   # report's ID=DIR
    elif flag in flags:
      out.append(flags[flag])
  return out


def _written_paths(cmd: Command) -> dict[str, tuple]:
  flags, _ = cmd.parsed()
  return {flags[f]: files for f, files in WRITES.get(cmd.binary, {}).items()
          if isinstance(flags.get(f), str)}


def chain_problems(commands: list[Command]) -> list[str]:
  """Everything that keeps the commands from running top to bottom as written."""
  problems, written = [], {}
  for i, cmd in enumerate(commands, 1):
    where = f"line {i} ({cmd.line!r})"
    if cmd.binary is None:
      if cmd.argv[:1] != ("pip",) and cmd.argv[:3] != ("python", "-m", "pytest"):
        problems.append(f"{where}: not a python -m experiments.<binary> command")
      continue
    if not os.path.exists(os.path.join(ROOT, "experiments", f"{cmd.binary}.py")):
      problems.append(f"{where}: experiments/{cmd.binary}.py does not exist")
      continue
    known = binary_flags(cmd.binary)
    flags, _ = cmd.parsed()
    for name, value in flags.items():
      base = name.split(".")[0]
      if base not in known and not (name.startswith("no") and known.get(name[2:]) == "bool"):
        problems.append(f"{where}: --{name} is not a flag of experiments.{cmd.binary}")
      if "." in name and known.get(base) != "config_file":
        problems.append(f"{where}: --{name}: experiments.{cmd.binary} has no config file flag "
                        f"--{base}")
      if known.get(name) == "config_file" and not os.path.exists(os.path.join(ROOT, value)):
        problems.append(f"{where}: --{name}={value} does not exist")
    for path in _read_paths(cmd):
      if _is_path_under_tmp(path):
        if path not in written:
          problems.append(f"{where} reads {path}, which no earlier line writes (written: "
                          f"{', '.join(written) or 'nothing'})")
      elif not os.path.exists(os.path.join(ROOT, path)):
        problems.append(f"{where} reads {path}, which does not exist")
    if cmd.binary in INTEROP and INTEROP_NOTE not in cmd.comment:
      problems.append(f"{where}: experiments.{cmd.binary} needs the interop extra; its comment "
                      f"must say {INTEROP_NOTE!r}")
    for path in _written_paths(cmd):
      written[path] = i
  return problems


def readme_commands() -> list[Command]:
  with open(README, encoding="utf-8") as f:
    return parse_readme(f.read())


# ---------------------------------------------------------------------------
# The default run: the structure.

def test_readme_chain_is_complete_as_written():
  commands = readme_commands()
  assert chain_problems(commands) == []
  binaries = [c.binary for c in commands if c.binary]
  # The chain the README promises: a fine-tune that trains, then its export.
  assert "finetune" in binaries and "export_hf" in binaries
  finetunes = [c for c in commands if c.binary == "finetune" and "workdir" in c.parsed()[0]]
  exports = [c for c in commands if c.binary == "export_hf"]
  assert exports and all(e.parsed()[0]["workdir"] in {f.parsed()[0]["workdir"] for f in finetunes}
                         for e in exports)


@pytest.mark.parametrize("edit, problem", [
    # a workdir renamed in one line only
    (lambda t: t.replace("--workdir=/tmp/moejax_default  #", "--workdir=/tmp/moejax_dflt  #", 1),
     "reads /tmp/moejax_default, which no earlier line writes"),
    # the export reads a fine-tune that no longer writes a workdir
    (lambda t: re.sub(r"(experiments\.finetune --source=/tmp/moejax_mixtral) --workdir=\S+",
                      r"\1", t), "reads /tmp/ft_mixtral, which no earlier line writes"),
    (lambda t: t.replace("--json_out=/tmp/layer.json", "--json_outt=/tmp/layer.json", 1),
     "--json_outt is not a flag of experiments.bench"),
    (lambda t: t.replace("--config=configs/default_mixtral.py", "--config=configs/mixtral.py"),
     "--config=configs/mixtral.py does not exist"),
    (lambda t: t.replace("python -m experiments.compare", "python -m experiments.comparee"),
     "experiments/comparee.py does not exist"),
    (lambda t: t.replace(INTEROP_NOTE, "needs torch"), "must say 'needs .[interop]'"),
])
def test_a_broken_chain_is_reported(edit, problem):
  with open(README, encoding="utf-8") as f:
    text = f.read()
  broken = edit(text)
  assert broken != text, "the edit no longer applies to README.md; update this test"
  problems = chain_problems(parse_readme(broken))
  assert len(problems) >= 1 and any(problem in p for p in problems), problems


def test_parsing_joins_continuations_splits_and_and_drops_comments():
  text = ("x\n```bash\npip install -e . && python -m experiments.train --workdir=/tmp/a  # c\n"
          "python -m experiments.finetune --source=/tmp/a \\\n    --workdir=/tmp/b --accounting"
          "\npython -m experiments.generate --prompt=\"a # b\"\n```\n")
  cmds = parse_readme(text)
  assert [c.argv for c in cmds] == [
      ("pip", "install", "-e", "."), ("python", "-m", "experiments.train", "--workdir=/tmp/a"),
      ("python", "-m", "experiments.finetune", "--source=/tmp/a", "--workdir=/tmp/b",
       "--accounting"),
      ("python", "-m", "experiments.generate", "--prompt=a # b")]
  assert cmds[1].comment == "c" and cmds[2].parsed() == ({"source": "/tmp/a",
                                                          "workdir": "/tmp/b",
                                                          "accounting": True}, [])
  assert chain_problems(cmds) == []


# ---------------------------------------------------------------------------
# -m slow: every command, in order.

_TRAIN = ("--config.train.steps=2", "--config.train.warmup_steps=1",
          "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.eval_batches=1", "--config.train.checkpoint_every=2")
_DATA = ("--config.data.stdlib_max_files=12", "--config.data.stdlib_val_fraction=0.3",
         "--config.data.batch_size=2", "--config.data.seq_len=16")
_MODEL = ("--config.model.d_model=32", "--config.model.n_layers=1",
          "--config.model.moe.topology.num_experts=4",
          "--config.model.moe.topology.expert_width=16")


def _prefixed(args, prefix):
  return tuple(a.replace("--config.", f"--config.{prefix}.", 1) for a in args)


def tiny_args(cmd: Command) -> tuple:
  """The overrides appended to ``cmd`` in the slow run (absl keeps the last value)."""
  flags, _ = cmd.parsed()
  if cmd.binary == "train":
    return _TRAIN + _DATA + _MODEL
  if cmd.binary == "finetune":
    return _TRAIN + _DATA
  if cmd.binary == "ablate":
    # A suite's base is a plain dict tree, whose None fields (data.stdlib_max_files) a
    # command line cannot override: the small corpus here is the synthetic one.
    return (_prefixed(_TRAIN + _MODEL, "base")
            + ("--config.base.train.eval_every=2", "--config.base.data.name=synthetic_domains",
               "--config.base.data.synthetic_train_docs=16",
               "--config.base.data.synthetic_val_docs=4",
               "--config.base.data.synthetic_max_doc_bytes=512", "--config.base.data.batch_size=2",
               "--config.base.data.seq_len=16", "--config.analysis.routing_batches=1"))
  if cmd.binary == "bench" and flags.get("suite") == "layer":
    return ("--tokens=64", "--d_model=32", "--shapes=coarse", "--repeats=1",
            "--torch_threads=1", "--variants=dense,blocked")
  if cmd.binary == "bench" and flags.get("suite") == "serving":
    return ("--serving_batches=1,2", "--serving_prompt=4", "--serving_steps=2",
            "--serving_prefill_repeats=1", "--serving_ffn_repeats=1", "--serving_d_model=32",
            "--serving_layers=1", "--serving_expert_width=16")
  if cmd.binary == "analyze_routing":
    return ("--max_tokens=16",)
  if cmd.binary == "generate":
    return ("--max_new_tokens=4",)
  if cmd.binary == "quantize":
    return ("--num_batches=1",)
  return ()


def _missing_extra(cmd: Command) -> Optional[str]:
  absent = [m for m in INTEROP.get(cmd.binary, ()) if importlib.util.find_spec(m) is None]
  return f"needs the interop extra ({', '.join(absent)} not installed)" if absent else None


class Chain:
  """Runs the README's commands in order, once each, in a scratch directory."""

  def __init__(self, base: str):
    self.base = base
    self.cwd = os.path.join(base, "cwd")
    self.tmp = os.path.join(base, "tmp")
    os.makedirs(self.tmp)
    os.makedirs(self.cwd)
    # What the commands read relative to the repository root (the README's working dir).
    os.symlink(os.path.join(ROOT, "configs"), os.path.join(self.cwd, "configs"))
    shutil.copy(os.path.join(ROOT, "RESULTS.md"), self.cwd)
    shutil.copytree(os.path.join(ROOT, "results"), os.path.join(self.cwd, "results"))
    self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                    TFDS_DATA_DIR=os.path.join(base, "tfds"),
                    JAX_COMPILATION_CACHE_DIR=os.path.join(base, "jax_cache"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    self.commands = [c for c in readme_commands() if c.binary]
    self.results: list = []   # per command: CompletedProcess, or a skip reason (str)
    self.skipped_outputs: set = set()

  def local(self, value: str) -> str:
    return re.sub(r"(?<![\w.])/tmp/", self.tmp + "/", value)

  def result(self, index: int):
    while len(self.results) <= index:
      self.results.append(self._run(self.commands[len(self.results)]))
    return self.results[index]

  def _run(self, cmd: Command):
    reason = _missing_extra(cmd)
    if reason is None and any(p in self.skipped_outputs for p in _read_paths(cmd)):
      reason = "reads the output of a skipped line"
    if reason is not None:
      self.skipped_outputs.update(_written_paths(cmd))
      return reason
    argv = [sys.executable, *cmd.argv[1:], *tiny_args(cmd)]
    started = time.time()
    proc = subprocess.run([self.local(a) for a in argv], cwd=self.cwd, env=self.env,
                          capture_output=True, text=True, timeout=900)
    proc.started = started
    return proc


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  return Chain(str(tmp_path_factory.mktemp("readme_chain")))


_COMMANDS = [c for c in readme_commands() if c.binary]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_COMMANDS)),
                         ids=[f"{i:02d}-{c.binary}" for i, c in enumerate(_COMMANDS)])
def test_readme_command_runs_as_written(chain, index):
  cmd = chain.commands[index]
  got = chain.result(index)
  if isinstance(got, str):
    pytest.skip(f"{cmd.line!r}: {got}")
  assert got.returncode == 0, (cmd.line, got.stdout[-2000:], got.stderr[-3000:])
  assert "Traceback" not in got.stderr, got.stderr[-3000:]
  for path, files in _written_paths(cmd).items():
    for name in files:
      where = os.path.join(chain.cwd, chain.local(path))   # a relative path: the command's cwd
      full = os.path.join(where, name) if name else where
      # Written by this command (report's RESULTS.md exists before it runs).
      assert os.path.exists(full) and os.path.getmtime(full) >= got.started - 1, (
          cmd.line, f"{full} was not written", got.stdout[-2000:])


def test_binary_flags_follow_the_shared_flags_and_the_bench_suites():
  assert binary_flags("train")["take_over_lock"] == "bool"
  assert binary_flags("generate")["step"] == "integer" and "dry_run" not in binary_flags(
      "generate")  # only the shared flags a binary calls for are its own
  bench = binary_flags("bench")
  assert {"suite", "json_out", "tokens", "step_twin", "serving_plot", "gmm_m",
          "repeats"} <= set(bench)
