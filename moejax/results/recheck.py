"""Is a committed result still what the code computes? Its first steps, re-trained bit for bit.

Legend: N probed steps of a run, A arms of a suite.

A suite run reads back the first N training steps of the first seed of every
arm (and of the suite's source) one by one and writes them beside the run
(``first_steps.json``, :mod:`moejax.ablation.first_steps`). ``experiments.report
ID=DIR --results_dir results`` keeps them as the block's **record**,
``results/recheck/ID.json`` (:func:`make_record`): per arm the full-precision
values of a fixed set of keys (:func:`recorded_keys`: loss, MaxVio, the
per-layer loads; keys added later do not count), the arm's resolved config,
its learning-rate schedule over the whole run, and the environment that
made them, the machine kind included (:func:`environment`: CPU model and the
instruction-set features XLA's CPU code generator targets, XLA flags, JAX
and jaxlib versions, devices).

:func:`recheck` re-trains those N steps at the current code and compares:

- on the record's machine kind, equal values mean **current** for the code
  those steps run; any difference means **stale**, naming the first arm,
  key and step that differ;
- on another machine kind the code XLA generates differs, so the numbers
  may differ with correct code: the re-check never says stale there, it
  reports the step where the curves part and how far (``machine``);
- unless the record keeps a **companion** for that kind: the same steps
  re-trained there at a code where the block was current on its own kind
  (:func:`with_companion`; ``experiments.recheck`` makes one when it meets
  such a code). Against a companion, equal means current and a difference
  stale, as on the record's kind. This rests on one assumption, said where
  the block is: a code change that moves no number on one kind moves none
  on the other (the code's arithmetic is the same; only the instructions
  XLA picks for it differ).

What N steps cannot reach keeps the file rule, narrowed to it: the arms'
configs (the schedule's tail, bias freeze steps and evaluation cadence are
config fields, compared field by field; fields added later do not count),
the learning-rate schedule's values over every step, and the code of the
final evaluation and the analyses (hashed as the runs ran it) and of the
statistics (hashed as the report that summarised them ran it; :data:`UNREACHED`), plus
fine-tuning code for suites whose arms fine-tune from the suite's source
(those arms are not re-trained; their source is). :func:`freshness` turns a
record and the checkout into the block's status line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import tempfile
from typing import Any, Mapping, Optional, Sequence

from moejax.ablation import freshness as files_lib
from moejax.ablation.first_steps import (  # noqa: F401  (write_record: the binaries' writer)
    FINETUNE_CODE, FIRST_STEPS_FILE, SUMMARY_CODE, UNREACHED, environment, file_hashes,
    recorded_keys, write_record)

FORMAT = 1
RECORD_DIR = "recheck"
SOURCE_ARM = "(source)"








def kind_differences(recorded: Mapping, now: Mapping) -> list[str]:
  """The fields of the machine kind that differ: ``["cpu: A -> B", ...]``."""
  a, b = recorded.get("kind", {}), now.get("kind", {})
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k)]


def flat_config(tree: Any, prefix: str = "") -> dict[str, Any]:
  """A resolved experiment (its JSON tree) as ``{"train.steps": 250, ...}``."""
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(flat_config(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def lr_digest(exp) -> str:
  """sha256 of the learning rate at every step of the run (float32): the schedule's tail
  is never reached by the first steps."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from moejax.train.optim import learning_rate_schedule  # pylint: disable=g-import-not-at-top
  lrs = np.asarray(learning_rate_schedule(exp.train)(np.arange(exp.train.steps + 1)), np.float32)
  return hashlib.sha256(lrs.tobytes()).hexdigest()[:16]


def unreached_scope(fine_tunes: bool) -> tuple[str, ...]:
  return UNREACHED + (FINETUNE_CODE if fine_tunes else ())






def unreached_fingerprint(scope: Sequence[str], hashes: Optional[Mapping[str, str]] = None
                          ) -> dict:
  """``{"fingerprint", "parts"}`` of the files under ``scope`` (``hashes``: recorded at a
  run; default: this checkout's)."""
  hashes = file_hashes(scope) if hashes is None else hashes
  total, parts = hashlib.sha256(), {}
  for path in sorted(p for p in hashes if any(p.startswith(s) for s in scope)):
    entry = f"{path}\0{hashes[path]}\n".encode()
    total.update(entry)
    parts.setdefault(files_lib.part(path), hashlib.sha256()).update(entry)
  return {"fingerprint": total.hexdigest()[:16],
          "parts": {k: h.hexdigest()[:12] for k, h in sorted(parts.items())}}


# --- Writing a record ----------------------------------------------------------






def make_record(sid: str, suite_dir: str, summary: Mapping) -> Optional[dict]:
  """The record of suite directory ``suite_dir`` (summary ``summary``, block ``sid``), or None
  when its runs wrote no first steps (a suite run before records existed)."""
  with open(os.path.join(suite_dir, "suite.json"), encoding="utf-8") as f:
    suite_json = json.load(f)
  seed = suite_json["seeds"][0]
  arms, fine_tunes, envs, hashes = {}, False, [], None
  from moejax.ablation.suite import run_dir  # pylint: disable=g-import-not-at-top
  n = len(suite_json["seeds"])
  runs = [(a, os.path.join(suite_dir, run_dir(a, seed, n))) for a in suite_json["arm_order"]]
  if suite_json.get("source") is not None:
    runs.insert(0, (SOURCE_ARM, os.path.join(suite_dir, run_dir("source", seed, n))))
  for arm, path in runs:
    steps_file = os.path.join(path, FIRST_STEPS_FILE)
    result_file = os.path.join(path, "result.json" if arm != SOURCE_ARM else "source_result.json")
    if not os.path.exists(result_file):
      return None
    with open(result_file, encoding="utf-8") as f:
      experiment = json.load(f)["experiment"]
    if experiment.get("finetune", {}).get("source"):
      fine_tunes = True
      arms[arm] = {"fine_tuned": True}
      continue
    if not os.path.exists(steps_file):
      return None
    with open(steps_file, encoding="utf-8") as f:
      first = json.load(f)
    envs.append(first.get("environment"))
    hashes = first.get("unreached_files") if hashes is None else hashes
    arms[arm] = {"metrics": {k: [r[k] for r in first["rows"]] for k in first["rows"][0]},
                 "config": flat_config(experiment), "lr": lr_digest(_experiment(experiment))}
  if hashes is not None:  # the statistics are this report's: hash them as they are now
    hashes = {**{p: h for p, h in hashes.items()
                 if not any(p.startswith(c) for c in SUMMARY_CODE)}, **file_hashes(SUMMARY_CODE)}
  prov = summary.get("provenance") or {}
  scope = unreached_scope(fine_tunes)
  return {"format": FORMAT, "id": sid, "suite": summary.get("suite"), "seed": seed,
          "steps": min(len(a["metrics"]["loss"]) for a in arms.values() if "metrics" in a),
          "command": (prov.get("commands") or [None])[0], "corpus": _corpus_id(summary),
          "environment": envs[0] if envs else None, "code": (prov.get("code") or [None])[0],
          "unreached_scope": list(scope),
          "unreached": None if hashes is None else unreached_fingerprint(scope, hashes),
          "arms": arms}


def _corpus_id(summary: Mapping) -> Optional[str]:
  ids = (summary.get("corpus") or {}).get("ids") or []
  return ids[0] if ids else None


def _experiment(tree: Mapping):
  from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
  return experiment_from_dict(tree)


def record_path(results_dir: str, sid: str) -> str:
  return os.path.join(results_dir, RECORD_DIR, f"{sid}.json")


def load_records(results_dir: str) -> dict[str, dict]:
  folder = os.path.join(results_dir, RECORD_DIR)
  if not os.path.isdir(folder):
    return {}
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".json"):
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        out[name[:-5]] = json.load(f)
  return out




# --- Comparing -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Difference:
  """The first value that differs: ``arm``'s ``key`` at 1-based ``step``."""
  arm: str
  key: str
  step: int
  recorded: Optional[float]
  now: Optional[float]

  def describe(self) -> str:
    if self.recorded is None or self.now is None:
      return f"arm {self.arm}: {self.key} {'missing now' if self.now is None else 'new'}"
    rel = abs(self.now - self.recorded) / max(abs(self.recorded), 1e-30)
    return (f"arm {self.arm}, {self.key} at step {self.step}: recorded {self.recorded!r}, "
            f"now {self.now!r} (relative {rel:.1e})")


def first_difference(recorded: Mapping[str, Mapping[str, Sequence[float]]],
                     now: Mapping[str, Mapping[str, Sequence[float]]]) -> Optional[Difference]:
  """The earliest step (then arm order, then key) where ``now`` is not bit-equal to
  ``recorded`` (per arm ``{key: [value per step]}``); keys only in ``now`` do not count."""
  found = []
  for arm, keys in recorded.items():
    for key, values in keys.items():
      got = (now.get(arm) or {}).get(key)
      if got is None:
        found.append((0, arm, key, Difference(arm, key, 0, values[0] if values else None, None)))
        continue
      for i, (a, b) in enumerate(zip(values, got)):
        if not _same(a, b):
          found.append((i + 1, arm, key, Difference(arm, key, i + 1, a, b)))
          break
  return min(found, key=lambda t: t[:3])[3] if found else None


def _same(a: float, b: float) -> bool:
  return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                    and math.isnan(b))


def largest_relative(recorded, now) -> float:
  """The largest relative difference of any recorded value (how far the curves part)."""
  worst = 0.0
  for arm, keys in recorded.items():
    for key, values in keys.items():
      for a, b in zip(values, (now.get(arm) or {}).get(key, [])):
        if not _same(a, b):
          worst = max(worst, abs(b - a) / max(abs(a), 1e-30))
  return worst


def config_changes(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """Recorded config fields whose value changed (fields added since do not count; a field
  that moved since is read in today's layout, :func:`moejax.train.config.current_layout`)."""
  from moejax.train.config import current_layout  # pylint: disable=g-import-not-at-top
  today = flat_config(current_layout(_unflatten(recorded)))
  # A recorded field missing from today's layout moved (or was a default dropped there).
  return [f"{k}: {today[k]!r} -> {now.get(k, '(removed)')!r}" for k in sorted(recorded)
          if k in today and now.get(k, "(removed)") != today[k]]


def _unflatten(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for key, value in flat.items():
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One block's re-check.

  Attributes:
    verdict: ``current`` (equal bit for bit on the record's machine kind),
      ``stale`` (something differs: ``reasons``), ``machine`` (another machine
      kind: ``first`` is where the curves part, None when they do not), or
      ``cannot`` (``reasons`` says why: another corpus, no record).
    reasons: what made it stale / uncheckable, one phrase each.
    first: the first differing value, if any.
    largest: the largest relative difference over the re-trained steps.
    machine: the machine-kind fields that differ from the record's.
    companion: the code fingerprint of the companion record judged against
      (another machine kind with a companion), else "".
    values: the re-trained values (per arm ``{key: [value per step]}``), kept
      out of :meth:`as_dict` (a companion is made from them).
  """
  verdict: str
  reasons: tuple[str, ...] = ()
  first: Optional[Difference] = None
  largest: float = 0.0
  machine: tuple[str, ...] = ()
  companion: str = ""
  values: Optional[Mapping] = dataclasses.field(default=None, compare=False, repr=False)

  def line(self, sid: str, steps: int) -> str:
    via = (f" on this machine kind, as its companion record made at code `{self.companion}`"
           if self.companion else "")
    if self.verdict == "current":
      return f"{sid}: current (the first {steps} steps of every arm retrain bit for bit{via})"
    if self.verdict == "stale":
      return f"{sid}: stale{via and ' (judged' + via + ')'}: " + "; ".join(self.reasons)
    if self.verdict == "machine":
      where = (f"the curves part at {self.first.describe()}; largest relative difference "
               f"{self.largest:.1e} over {steps} steps" if self.first else
               f"the curves are equal bit for bit over {steps} steps")
      return (f"{sid}: another machine kind ({'; '.join(self.machine)}): not judged; {where}")
    return f"{sid}: cannot re-check: " + "; ".join(self.reasons)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(dataclasses.replace(self, values=None))
    del d["values"]
    d["reasons"], d["machine"] = list(self.reasons), list(self.machine)
    return d


def companion_for(record: Mapping, env_now: Mapping) -> Optional[dict]:
  """The record's companion made on ``env_now``'s machine kind, if any and if it holds every
  arm the record re-trains (one that does not would leave an arm unjudged)."""
  kind, arms = env_now.get("kind"), {a for a, r in record["arms"].items() if "metrics" in r}
  return next((c for c in record.get("companions") or []
               if c.get("kind") == kind and arms <= set(c.get("metrics") or {})), None)


def with_companion(record: Mapping, env_now: Mapping, code: str, values: Mapping) -> dict:
  """``record`` with a companion for ``env_now``'s machine kind: ``values`` re-trained there
  at code fingerprint ``code``, where the block is current on its own kind (the caller
  knows it is: :func:`freshness` says ``current``). It replaces an older one of that kind."""
  others = [c for c in record.get("companions") or [] if c.get("kind") != env_now.get("kind")]
  made = {"kind": env_now.get("kind"), "code": code, "metrics": values}
  return {**record, "companions": others + [made]}


def store_outcome(record: Mapping, got: Mapping, code_now: Optional[Mapping]
                  ) -> tuple[dict, bool]:
  """``(record, made)``: ``record`` (as it was before the re-check) updated with one
  re-check's result ``got`` (the ``outcome`` dict, ``values``, ``code`` and
  ``environment`` of a re-check process), ``code_now`` this checkout's fingerprint.

  On another machine kind with no companion, at a code where the block is current
  (:func:`freshness` of ``record`` says so, and the re-check ran ``code_now``), the
  values become the companion for that kind (``made``) and the earlier check stays;
  otherwise the outcome becomes the record's ``check``.
  """
  out = got["outcome"]
  fp_now = (code_now or {}).get("fingerprint")
  if (out["verdict"] == "machine" and got.get("values") and fp_now is not None
      and got.get("code") == fp_now
      and (freshness(record, code_now) or ("",))[0] == "current"):
    return with_companion(record, got["environment"], got["code"], got["values"]), True
  check = {"verdict": out["verdict"], "reasons": out["reasons"], "machine": out["machine"],
           "code": got["code"], "environment": got.get("environment"), "first": out["first"],
           "largest": out["largest"], "companion": out.get("companion", "")}
  return {**record, "check": check}, False


def judge(record: Mapping, now_metrics: Mapping, now_configs: Mapping[str, Mapping],
          now_lr: Mapping[str, str], env_now: Mapping, unreached_now: Optional[Mapping]
          ) -> Outcome:
  """The verdict from what was re-computed (pure: the tests feed it hand-made values)."""
  reasons = []
  rec_unreached = record.get("unreached") or {}
  if (unreached_now or {}).get("fingerprint") != rec_unreached.get("fingerprint"):
    old, new = rec_unreached.get("parts", {}), (unreached_now or {}).get("parts", {})
    parts = sorted(p for p in set(old) | set(new) if old.get(p) != new.get(p))
    reasons.append("code the first steps do not reach changed (" + ", ".join(parts) + ")")
  for arm, rec in record["arms"].items():
    if "config" in rec and arm in now_configs:
      changed = config_changes(rec["config"], now_configs[arm])
      if changed:
        reasons.append(f"arm {arm}'s config changed ({'; '.join(changed[:3])}"
                       + (f"; {len(changed) - 3} more" if len(changed) > 3 else "") + ")")
    if "lr" in rec and arm in now_lr and now_lr[arm] != rec["lr"]:
      reasons.append(f"arm {arm}'s learning-rate schedule changed")
  recorded = {a: r["metrics"] for a, r in record["arms"].items() if "metrics" in r}
  machine = tuple(kind_differences(record.get("environment", {}), env_now))
  companion = companion_for(record, env_now) if machine else None
  if companion is not None:
    recorded = {a: m for a, m in companion["metrics"].items() if a in recorded}
  first = first_difference(recorded, now_metrics)
  largest = largest_relative(recorded, now_metrics)
  if machine and companion is None:
    return Outcome("machine", tuple(reasons), first, largest, machine, values=now_metrics)
  if first is not None:
    reasons.insert(0, "first difference: " + first.describe())
  return Outcome("stale" if reasons else "current", tuple(reasons), first, largest,
                 companion=companion["code"] if companion else "", values=now_metrics)


# --- Re-training -------------------------------------------------------------------


def probe_run(exp, steps: int, finetune_start=None) -> list[dict]:
  """The first ``steps`` steps of ``exp`` trained in a scratch directory, read back."""
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  from moejax.train.context import Probe  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="moejax_recheck_") as tmp:
    out = loop.train(exp, os.path.join(tmp, "run"), out=io.StringIO(),
                     probe=Probe(steps, stop=True), start=finetune_start)
  return [recorded_keys(r) for r in out["probed_rows"]]


def _seeded(exp, seed: int):
  # As moejax.ablation.sources.seeded (which imports this module for the suite's probes).
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, seed=seed))


def recheck(record: Mapping, suite, corpus_id: Optional[str] = None,
            arms: Optional[Sequence[str]] = None) -> Outcome:
  """Re-trains the record's first steps of ``suite`` (a :class:`moejax.ablation.suite.Suite`
  built from the current configs) and judges them against ``record``; ``arms``: only
  these (default: every arm the record has)."""
  if arms is not None:
    record = {**record, "arms": {a: r for a, r in record["arms"].items() if a in arms}}
  from moejax.train.config import experiment_to_json  # pylint: disable=g-import-not-at-top
  if corpus_id is not None and record.get("corpus") not in (None, corpus_id):
    return Outcome("cannot", (f"the record's corpus is {record['corpus']}, this machine's "
                              f"{corpus_id} (another Python: the corpus is its standard "
                              "library)",))
  steps = int(record["steps"])
  metrics, configs, lrs = {}, {}, {}
  seed = record["seed"]
  for arm, rec in record["arms"].items():
    if rec.get("fine_tuned"):
      continue
    if arm == SOURCE_ARM:
      exp = _seeded(suite.source, seed) if suite.source is not None else None
    else:
      exp = (_seeded(suite.arm(arm).experiment, seed)
             if arm in {a.name for a in suite.arms} else None)
    if exp is None:
      metrics[arm], configs[arm] = {}, {}
      continue
    exp = exp.for_platform()
    configs[arm] = flat_config(json.loads(experiment_to_json(exp)))
    lrs[arm] = lr_digest(exp)
    rows = probe_run(exp, steps)
    metrics[arm] = {k: [r.get(k) for r in rows] for k in rows[0]} if rows else {}
  scope = record.get("unreached_scope") or UNREACHED
  return judge(record, metrics, configs, lrs, environment(), unreached_fingerprint(scope))


# --- The block's status line --------------------------------------------------------


def machine_line(record: Mapping) -> str:
  """The block's machine-kind line: the CPU and its widest vector extension XLA targets.

  The code XLA:CPU generates, and so a run's last digits, depend on them; a
  reader comparing blocks needs to know which ran on which kind.
  """
  kind = (record.get("environment") or {}).get("kind") or {}
  if not kind:
    return ""
  return (f"- machine kind: {_kind_words(kind)} (another kind gives other last digits: "
          "RESULTS.md's machine-spread tables measure how far they move)\n")


def record_kind(record: Optional[Mapping]) -> Optional[str]:
  """The machine kind a block's runs were made on, in words (None: no record of it)."""
  kind = ((record or {}).get("environment") or {}).get("kind")
  return _kind_words(kind) if kind else None


def _kind_words(kind: Mapping) -> str:
  """``"CPU with AVX2[, XLA_FLAGS `...`]"``: a machine kind as a block's lines name it."""
  isa = kind.get("isa") or []
  widest = next((name for name, key in (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AVX", "avx"))
                 if key in isa), "no AVX")
  flags = f", XLA_FLAGS `{kind['xla_flags']}`" if kind.get("xla_flags") else ""
  return f"{kind.get('cpu') or 'unknown CPU'} with {widest}{flags}"


def _check_kind(check: Mapping) -> str:
  return record_kind(check) or "another machine kind"


def freshness(record: Optional[Mapping], code_now: Optional[Mapping]) -> Optional[tuple[str, str]]:
  """``(state, line)`` of a block from its record, or None when it has none (the plain file
  rule applies). state: ``current`` / ``stale`` / ``due`` (code changed since the last
  re-check: run it) / ``machine`` (last re-checked on another machine kind). The line ends
  with the record's :func:`machine_line`."""
  if record is None or record.get("environment") is None:
    return None
  state, line = _state_line(record, code_now)
  return state, line + machine_line(record)


def _state_line(record: Mapping, code_now: Optional[Mapping]) -> tuple[str, str]:
  cmd = f"python -m experiments.recheck {record['id']}"
  unreached_now = unreached_fingerprint(record.get("unreached_scope") or UNREACHED)
  rec_u = (record.get("unreached") or {}).get("fingerprint")
  if rec_u != (unreached_now or {}).get("fingerprint"):
    return ("stale", "- **stale**: code that the re-check cannot reach (evaluation, analysis, "
            "statistics) changed since these runs; re-run the command below\n")
  check = record.get("check")
  fp_now = (code_now or {}).get("fingerprint")
  steps = record["steps"]
  if check and check.get("code") == fp_now:
    v = check["verdict"]
    if v == "current" and check.get("companion"):
      return ("current", f"- code: current (re-checked on {_check_kind(check)}: the first "
              f"{steps} steps of every arm retrain bit for bit at code fingerprint `{fp_now}` "
              f"as they did there at `{check['companion']}`, where the block was current on "
              f"its own kind; this assumes a change that moves no number on one kind moves "
              f"none on the other; `{cmd}`)\n")
    if v == "current":
      return ("current", f"- code: current (re-checked: the first {steps} steps of every arm "
              f"retrain bit for bit at code fingerprint `{fp_now}`; `{cmd}`)\n")
    if v == "stale":
      via = (f" (on {_check_kind(check)}, against its companion record made at "
             f"`{check['companion']}`)" if check.get("companion") else "")
      return ("stale", f"- **stale**{via}: {'; '.join(check['reasons'])}; re-run the command "
              "below\n")
    return ("machine", f"- re-checked on another machine kind only ({'; '.join(check['machine'])}"
            f"): not judged; `{cmd}` on the record's machine kind decides\n")
  if (record.get("code") or {}).get("fingerprint") == fp_now:
    return ("current", f"- code: current (the runs' own code, fingerprint `{fp_now}`)\n")
  return ("due", f"- **re-check due**: code changed since these runs' last check; `{cmd}` "
          "says whether any number moved\n")
