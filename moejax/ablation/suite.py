"""An equal-budget ablation suite: a base experiment, arms, what is held fixed, seeds.

A suite file (``configs/ablations/<name>.py``) has a ``get_config()`` that
returns an ``ml_collections.ConfigDict`` (or a plain dict) with:

- ``name``: the suite's name; ``description``: what it studies and its size;
- ``base``: a complete experiment tree (``{model, data, train}``, as the
  ``configs/*.py`` files return);
- ``arms``: ``{arm_name: overrides}``, each a nested dict merged into
  ``base`` (a key absent from the base is an error: arms can only change
  existing fields, so a typo is caught);
- ``fixed``: ``{quantity: relative tolerance}`` the arms must agree on, with
  quantity in :data:`QUANTITIES` (``optimizer`` and ``tokens`` take 0: exact);
- ``seeds``: ``train.seed`` values, every arm trained once per seed with the
  same data order (``data.seed`` stays the base's);
- ``baseline``: the arm every other arm is compared with (paired differences,
  intervals and verdicts, :mod:`moejax.ablation.stats`); default: the first
  arm. A reproduction names the published reference arm;
- ``reproduction``: True for a suite that reproduces a published result; it
  must then run at least :data:`MIN_REPRODUCTION_SEEDS` seeds, so that its
  verdicts have an interval over seeds;
- ``scale``: the rung of the scale ladder, ``s`` (default), ``m`` or ``l``
  (:mod:`moejax.ablation.scale`), applied to every arm's experiment after
  its overrides (``--config.scale=m``);
- ``analysis``: optional measurements: ``causal_probe`` (bool),
  ``comm_devices`` (expert-parallel devices of the all-to-all accounting, 8),
  ``latency`` (bool, True) and ``latency_reps`` (30), ``routing_batches``
  (validation batches of the routing pass, 4), ``speedup_reference`` (an
  arm: every arm's steps and wall time to reach that arm's final validation
  loss, :mod:`moejax.ablation.speedup`), ``routing_consistency`` (perturbation names of
  :mod:`moejax.serve.routing_consistency`: each arm's flip rates under them, on the
  routing sample's first batches, :data:`moejax.ablation.analysis.CONSISTENCY_BATCHES`),
  ``replay_finetune`` (``{'perturbation': name, 'steps': n}``: each arm fine-tuned
  n steps on its own routing and on a perturbed forward's replayed routing,
  :mod:`moejax.ablation.replay_finetune`);
- ``exempt``: ``{arm: (quantity, ...)}``: reference arms the budget check
  does not hold to those fixed quantities (a dense model with the MoE's
  total parameters cannot also match its active FLOPs); printed as exempt;
- ``compare_to``: ``{arm: other arm}``: the arm its differences are taken
  against instead of ``baseline`` (``'-'``: no comparison), for suites
  whose arms pair up (router frozen vs unfrozen within each data mixture);
- ``match_compute``: ``{arm: reference arm}``: the arm's ``train.steps`` are
  set (after scaling) so that its training compute, FLOPs per token x tokens,
  equals the reference's, rounded to whole steps: an arm that spends more
  FLOPs per token (multi-token prediction's modules) trains on fewer tokens.
  The budget check then holds ``compute`` like any other fixed quantity;
- ``source``: an experiment tree trained first, once per seed, in
  ``DIR/source[/seed_<s>]``; arms with ``finetune.source='suite:source'``
  fine-tune from the run of their seed (:data:`SUITE_SOURCE`).

:func:`load_suite` turns it into a validated, frozen :class:`Suite` whose
arms are full :class:`~moejax.train.config.ExperimentConfig` objects.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from typing import Any, Mapping

from moejax.ablation import scale as scale_lib
from moejax.config import ConfigError, to_dict
from moejax.topology.accounting import budget as model_budget
from moejax.train.config import ExperimentConfig, experiment_from_dict

QUANTITIES = ("total", "active", "flops_per_token", "tokens", "optimizer")
SUITE_KEYS = ("name", "description", "base", "arms", "fixed", "seeds", "baseline",
              "reproduction", "analysis", "scale")
MIN_REPRODUCTION_SEEDS = 3
# Fine-tuning and reference arms (see the module docstring).
QUANTITIES = QUANTITIES + ("trainable",)
# Compute including a fine-tuning arm's source (moejax.ablation.budget): upcycling suites.
QUANTITIES = QUANTITIES + ("total_tokens", "compute")
SUITE_KEYS = SUITE_KEYS + ("exempt", "compare_to", "source", "effects", "match_compute")
SUITE_SOURCE = "suite:source"   # finetune.source of arms that start from the suite's source run
NO_COMPARISON = "-"
ANALYSIS_KEYS = ("causal_probe", "comm_devices", "latency", "latency_reps", "routing_batches",
                 "speedup_reference", "routing_consistency", "replay_finetune")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm: its name, the overrides it applies and the resulting experiment."""

  name: str
  overrides: Mapping[str, Any]
  experiment: ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Suite:
  """A validated suite (see the module docstring for the fields)."""

  name: str
  description: str
  arms: tuple
  fixed: Mapping[str, float]
  seeds: tuple
  analysis: Mapping[str, Any]
  exempt: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  compare_to: Mapping[str, str] = dataclasses.field(default_factory=dict)
  source: Any = None   # the source ExperimentConfig, or None
  baseline: str = ""
  reproduction: bool = False
  # {metric: {"size": X, "source": why X}}: the effect each comparison is judged against
  # (moejax.ablation.power: bounded verdicts, seeds for 80% power).
  effects: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  scale: str = scale_lib.DEFAULT_SCALE
  match_compute: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def arm(self, name: str) -> Arm:
    for a in self.arms:
      if a.name == name:
        return a
    raise KeyError(f"suite {self.name} has no arm {name!r}; arms: {[a.name for a in self.arms]}")

  def runs(self):
    """(arm, seed, relative run dir) for every run, in training order."""
    for a in self.arms:
      for s in self.seeds:
        yield a, s, run_dir(a.name, s, len(self.seeds))

  def source_runs(self):
    """(seed, relative dir) of the source runs (none without ``source``), trained first."""
    if self.source is None:
      return
    for s in self.seeds:
      yield s, run_dir("source", s, len(self.seeds))


def run_dir(arm: str, seed: int, num_seeds: int) -> str:
  """``<arm>`` for a one-seed suite, ``<arm>/seed_<s>`` otherwise."""
  return arm if num_seeds == 1 else os.path.join(arm, f"seed_{seed}")


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any], path: str = "") -> dict:
  """``base`` with ``overrides`` merged in; an override key absent from the base is an error.

  A sub-config that is None in the base (a dense model's ``moe``) may be
  replaced by a whole dict. An idea's options belong to its kind (a router's
  ``options``, a layer kind's ``layer_options``): an override that changes
  ``routing.kind`` or ``moe.kind`` replaces them (with its own options, or the
  new kind's defaults), instead of merging into the old kind's.
  """
  out = copy.deepcopy(dict(base))
  if "kind" in overrides and overrides["kind"] != out.get("kind"):
    for opts in ("options", "layer_options"):
      if opts in set(out) | set(overrides):
        out[opts] = copy.deepcopy(overrides.get(opts) or {})
    overrides = {k: v for k, v in overrides.items() if k not in ("options", "layer_options")}
  for key, value in overrides.items():
    where = f"{path}.{key}" if path else key
    if key not in out:
      raise ConfigError(where, value, "is not a field of the base experiment",
                        f"check the spelling; fields here: {sorted(out)}")
    if isinstance(value, Mapping) and isinstance(out[key], Mapping):
      out[key] = merge(out[key], value, where)
    else:
      out[key] = copy.deepcopy(value)
  return out


def _plain(tree: Any) -> Any:
  if hasattr(tree, "to_dict"):
    tree = tree.to_dict()
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree


def suite_from_dict(tree: Mapping[str, Any] | Any) -> Suite:
  """A :class:`Suite` from a suite tree; every problem is a ConfigError before any compute."""
  tree = _plain(tree)
  for key in tree:
    if key not in SUITE_KEYS:
      raise ConfigError(f"suite.{key}", tree[key], "is not a suite field",
                        f"use one of {', '.join(SUITE_KEYS)}")
  for key in ("name", "base", "arms"):
    if key not in tree:
      raise ConfigError(f"suite.{key}", None, "is missing", f"add {key} to get_config()")
  name = tree["name"]
  arms_tree = tree["arms"]
  if not isinstance(arms_tree, Mapping) or len(arms_tree) < 2:
    raise ConfigError("suite.arms", arms_tree, "needs at least two arms",
                      "add arms as {name: overrides}")
  fixed = dict(tree.get("fixed") or {})
  for q, tol in fixed.items():
    if q not in QUANTITIES:
      raise ConfigError(f"suite.fixed.{q}", tol, "is not a budget quantity",
                        f"use one of {', '.join(QUANTITIES)}")
    if not isinstance(tol, (int, float)) or tol < 0:
      raise ConfigError(f"suite.fixed.{q}", tol, "must be a relative tolerance >= 0",
                        "use e.g. 0.02 for 2%")
  seeds = tuple(tree.get("seeds") or (0,))
  if not all(isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
    raise ConfigError("suite.seeds", seeds, "must be distinct ints >= 0", "e.g. seeds=(0, 1)")
  baseline = tree.get("baseline") or next(iter(arms_tree))
  if baseline not in arms_tree:
    raise ConfigError("suite.baseline", baseline, "is not an arm of the suite",
                      f"set suite.baseline to one of {list(arms_tree)} (default: the first arm)")
  reproduction = tree.get("reproduction", False)
  if not isinstance(reproduction, bool):
    raise ConfigError("suite.reproduction", reproduction, "must be True or False",
                      "set reproduction=True for a suite that reproduces a published result")
  if reproduction and len(seeds) < MIN_REPRODUCTION_SEEDS:
    raise ConfigError(
        "suite.seeds", seeds, f"has {len(seeds)} seed(s), but suite.reproduction=True needs at "
        f"least {MIN_REPRODUCTION_SEEDS} (a verdict needs an interval over seeds)",
        f"set seeds=(0, 1, 2) (--config.seeds='(0,1,2)'), or reproduction=False for a "
        "quick look")
  analysis = dict(tree.get("analysis") or {})
  for key in analysis:
    if key not in ANALYSIS_KEYS:
      raise ConfigError(f"suite.analysis.{key}", analysis[key], "is not an analysis option",
                        f"use one of {', '.join(ANALYSIS_KEYS)}")
  if analysis.get("routing_consistency"):
    _check_perturbations(analysis["routing_consistency"])
  if analysis.get("replay_finetune"):
    from moejax.ablation import replay_finetune  # pylint: disable=g-import-not-at-top
    replay_finetune.check_options(analysis["replay_finetune"])
  scale = scale_lib.get_scale(tree.get("scale") or scale_lib.DEFAULT_SCALE)
  references = _references(tree, arms_tree, scale)
  effects = _effects(tree.get("effects") or {})
  base_tree = _base_tree(tree["base"])
  arms = []
  for arm_name, overrides in arms_tree.items():
    if not arm_name or "/" in arm_name or arm_name.startswith("."):
      raise ConfigError("suite.arms", arm_name, "is not a usable directory name",
                        "use letters, digits, '_' or '-'")
    overrides = dict(overrides or {})
    exp_tree = merge(base_tree, overrides, f"suite.arms.{arm_name}")
    try:
      exp = experiment_from_dict(scale_lib.scale_experiment(exp_tree, scale))
    except ConfigError as e:
      at = f" at suite.scale={scale.name}" if scale.name != scale_lib.DEFAULT_SCALE else ""
      raise e.within(f"suite.arms.{arm_name} builds an invalid experiment{at}") from e
    arms.append(Arm(arm_name, overrides, exp))
  match = _match_compute(tree, arms_tree)
  by_name = {a.name: a for a in arms}  # the references as built, before any is matched
  arms = [_compute_matched(a, by_name[match[a.name]]) if a.name in match else a for a in arms]
  return _check_source_use(Suite(
      name=name, description=tree.get("description", ""), arms=tuple(arms), fixed=fixed,
      seeds=seeds, analysis=analysis, baseline=baseline, reproduction=reproduction,
      scale=scale.name, effects=effects, match_compute=match, **references))


def _match_compute(tree: Mapping[str, Any], arms_tree: Mapping[str, Any]) -> dict:
  """``suite.match_compute`` checked: arms matched to arms that are not matched themselves."""
  match = dict(tree.get("match_compute") or {})
  for arm, ref in match.items():
    if arm not in arms_tree or ref not in arms_tree:
      raise ConfigError(f"suite.match_compute.{arm}", ref, "names an arm the suite does not have",
                        f"map arms to reference arms among {list(arms_tree)}")
    if ref == arm or ref in match:
      raise ConfigError(f"suite.match_compute.{arm}", ref,
                        "must name an arm whose steps are its own (not matched itself)",
                        "match every arm to the same reference arm, e.g. the baseline")
  return match


def _compute_matched(arm: Arm, ref: Arm) -> Arm:
  """``arm`` with the train.steps that spend ``ref``'s training compute (see the module doc)."""
  def compute_per_step(exp):
    fpt = model_budget(exp.model, exp.data.seq_len).flops_per_token
    return fpt * exp.data.batch_size * exp.data.seq_len
  r, e = ref.experiment, arm.experiment
  steps = max(1, round(r.train.steps * compute_per_step(r) / compute_per_step(e)))
  tree = to_dict(e)
  tree["train"]["steps"] = steps
  try:
    exp = experiment_from_dict(tree)
  except ConfigError as err:
    raise err.within(f"suite.arms.{arm.name} at the {steps} steps that match the compute of "
                     f"arm {ref.name!r} (suite.match_compute)") from err
  return Arm(arm.name, arm.overrides, exp)


def _check_perturbations(names) -> None:
  """``suite.analysis.routing_consistency``: registered perturbation names, before training."""
  # pylint: disable=g-import-not-at-top
  from moejax.serve.perturbation import PERTURBATIONS
  from moejax.serve import routing_consistency  # noqa: F401  (registers the shipped ones)
  field = "suite.analysis.routing_consistency"
  if isinstance(names, str) or not all(isinstance(n, str) for n in names):
    raise ConfigError(field, names, "must be a list of perturbation names",
                      "write e.g. ('bf16', 'int8', 'int4')")
  unknown = [n for n in names if n not in PERTURBATIONS]
  if unknown:
    raise ConfigError(field, list(names), f"names unknown perturbations {unknown}",
                      f"pick from {', '.join(sorted(PERTURBATIONS))}")


def suite_effects(tree: Mapping[str, Any] | Any) -> dict:
  """The validated ``effects`` of a suite tree (``{}`` when it states none)."""
  return _effects(_plain(tree).get("effects") or {})


def _effects(tree: Mapping[str, Any]) -> dict:
  """``suite.effects`` validated: per verdict metric a size > 0 and the source of it."""
  from moejax.ablation.columns import VERDICT_METRICS  # pylint: disable=g-import-not-at-top
  out = {}
  for metric, spec in dict(tree).items():
    where = f"suite.effects.{metric}"
    if metric not in VERDICT_METRICS:
      raise ConfigError(where, spec, "is not a metric with a verdict",
                        f"use one of {', '.join(VERDICT_METRICS)}")
    spec = dict(spec) if isinstance(spec, Mapping) else {}
    size, source = spec.get("size"), spec.get("source")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
      raise ConfigError(f"{where}.size", size, "must be a difference > 0 in the metric's units",
                        "give the published difference, or the smallest that would matter")
    if not isinstance(source, str) or not source.strip():
      raise ConfigError(f"{where}.source", source, "must say where the size comes from",
                        "cite the paper and table, or say why this difference matters")
    out[metric] = {"size": float(size), "source": source.strip()}
  return out


def _base_tree(base: Any) -> dict:
  """The base experiment built and back as a dict: every default present, knobs resolved."""
  try:
    return to_dict(experiment_from_dict(base))
  except ConfigError as e:
    raise e.within("suite.base (the experiment every arm changes) is not valid") from e


def base_experiment(tree: Mapping[str, Any] | Any) -> ExperimentConfig:
  """The suite's base experiment at its ``scale`` (what ``--print_config`` diffs arms against)."""
  tree = _plain(tree)
  scale = scale_lib.get_scale(tree.get("scale") or scale_lib.DEFAULT_SCALE)
  return experiment_from_dict(scale_lib.scale_experiment(_base_tree(tree["base"]), scale))



def _references(tree: Mapping[str, Any], arms_tree: Mapping[str, Any], scale) -> dict:
  """``exempt``, ``compare_to`` and ``source`` of the suite tree, checked (see the module doc).

  The source is scaled like the arms, so that a fine-tuning arm at any rung
  of the ladder starts from a model of its own shapes.
  """
  exempt = {}
  for arm, qs in dict(tree.get("exempt") or {}).items():
    if arm not in arms_tree:
      raise ConfigError(f"suite.exempt.{arm}", qs, "is not an arm of the suite",
                        f"use arms among {list(arms_tree)}")
    qs = (qs,) if isinstance(qs, str) else tuple(qs)
    for q in qs:
      if q not in QUANTITIES:
        raise ConfigError(f"suite.exempt.{arm}", qs, f"{q!r} is not a budget quantity",
                          f"use quantities among {', '.join(QUANTITIES)}")
    exempt[arm] = qs
  compare_to = {}
  for arm, other in dict(tree.get("compare_to") or {}).items():
    if arm not in arms_tree or (other not in arms_tree and other != NO_COMPARISON):
      raise ConfigError(f"suite.compare_to.{arm}", other, "names an arm the suite does not have",
                        f"map arms to arms among {list(arms_tree)} (or {NO_COMPARISON!r}: none)")
    if other == arm:
      raise ConfigError(f"suite.compare_to.{arm}", other, "compares an arm with itself",
                        f"use {NO_COMPARISON!r} for no comparison")
    compare_to[arm] = other
  ref = dict(tree.get("analysis") or {}).get("speedup_reference")
  if ref is not None and ref not in arms_tree:
    raise ConfigError("suite.analysis.speedup_reference", ref, "is not an arm of the suite",
                      f"name the reference arm, one of {list(arms_tree)}")
  source = None
  if tree.get("source") is not None:
    try:
      source = experiment_from_dict(scale_lib.scale_experiment(
          to_dict(experiment_from_dict(tree["source"])), scale))
    except ConfigError as e:
      raise e.within("suite.source is not a valid experiment") from e
  return {"exempt": exempt, "compare_to": compare_to, "source": source}


def _check_source_use(suite: "Suite") -> "Suite":
  users = [a.name for a in suite.arms if a.experiment.finetune.source == SUITE_SOURCE]
  if users and suite.source is None:
    raise ConfigError("suite.source", None, f"arms {users} fine-tune from {SUITE_SOURCE!r}, but "
                      "the suite has no source", "add source=<experiment tree> to the suite")
  if suite.source is not None and not users:
    raise ConfigError("suite.source", "...", f"no arm fine-tunes from it (finetune.source="
                      f"{SUITE_SOURCE!r})", "set finetune.source in the arms, or drop source")
  return suite


def load_suite_file(path: str):
  """The ``get_config()`` tree of a suite file (not yet validated)."""
  if not os.path.exists(path):
    raise ConfigError("--config", path, "does not exist",
                      "pass a file such as configs/ablations/quick.py")
  spec = importlib.util.spec_from_file_location(f"_suite_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def load_suite(path: str) -> Suite:
  return suite_from_dict(load_suite_file(path))
