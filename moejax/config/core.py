"""Config machinery shared by every section: errors, value checks, dicts and overrides.

Every config class is a frozen dataclass that checks its own fields in
``__post_init__`` with the helpers here; a failure raises
:class:`ConfigError` naming the dotted field, the offending value and a fix.
Configs are built from plain nested dicts (what an ``ml_collections``
``get_config()`` file produces) by :func:`from_dict`: an unknown key anywhere
in the tree is an error with a "did you mean" hint, and a key that moved in
the config tree names its new place (:data:`MOVED`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import numbers
import types
import typing
from typing import Any, Mapping, Optional


class ConfigError(ValueError):
  """A config value is invalid; the message names field, value and fix.

  ``where`` (optional) says what the field belongs to when it is checked as
  part of something larger (a suite's base experiment, one of its arms):
  ``"suite.base: train.steps=0: must be >= 1. Fix: set train.steps >= 1"``.
  """

  def __init__(self, field: str, value: Any, problem: str, fix: str, where: str = ""):
    self.field, self.value, self.problem, self.fix, self.where = field, value, problem, fix, where
    prefix = f"{where}: " if where else ""
    super().__init__(f"{prefix}{field}={value!r}: {problem}. Fix: {fix}")

  def within(self, where: str) -> "ConfigError":
    """This error reported as part of ``where``: one line, still the one specific Fix.

    (Wrapping the message in a new ConfigError would end it with two Fixes,
    the specific one and a generic "fix the ..." of the wrapper.)
    """
    outer = f"{where}: {self.where}" if self.where else where
    return ConfigError(self.field, self.value, self.problem, self.fix, where=outer)


# --- Value checks. -----------------------------------------------------------

def check_choice(path: str, value: Any, choices: tuple) -> None:
  if value not in choices:
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    fix = f"use one of {', '.join(map(str, choices))}"
    if hint:
      fix = f"did you mean {hint[0]!r}? ({fix})"
    raise ConfigError(path, value, "unknown value", fix)


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(path: str, value: Any, *, minimum: Optional[float] = None,
                 maximum: Optional[float] = None, min_open: bool = False,
                 max_open: bool = False, integer: bool = False, fix: str = "") -> None:
  """A finite real (or int) in [minimum, maximum] (open ends when ``*_open``).

  NaN fails every comparison, so a check written as ``value < 0`` lets it
  through; infinity passes ``> 0``. Both are refused here first.
  """
  if integer:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      raise ConfigError(path, value, "must be an integer", fix or f"set {path} to an int")
  elif not _is_number(value):
    raise ConfigError(path, value, "must be a number", fix or f"set {path} to a number")
  if not math.isfinite(value):
    raise ConfigError(path, value, "must be finite", fix or f"set {path} to a finite number")
  low_bad = minimum is not None and (value <= minimum if min_open else value < minimum)
  high_bad = maximum is not None and (value >= maximum if max_open else value > maximum)
  if low_bad or high_bad:
    lo = "" if minimum is None else ("(" if min_open else "[") + f"{minimum:g}"
    hi = "" if maximum is None else f"{maximum:g}" + (")" if max_open else "]")
    if minimum is not None and maximum is not None:
      where = f"in {lo}, {hi}"
    elif minimum is not None:
      where = f"{'>' if min_open else '>='} {minimum:g}"
    else:
      where = f"{'<' if max_open else '<='} {maximum:g}"
    raise ConfigError(path, value, f"must be {where}", fix or f"set {path} {where}")


def check_positive(path: str, value: Any, allow_zero: bool = False) -> None:
  """A finite number > 0 (>= 0 with ``allow_zero``)."""
  check_number(path, value, minimum=0, min_open=not allow_zero)


def check_count(path: str, value: Any, minimum: int = 1) -> None:
  """An integer >= minimum."""
  check_number(path, value, minimum=minimum, integer=True)


def check_fraction(path: str, value: Any, *, allow_zero: bool = False, fix: str = "") -> None:
  """A finite number in (0, 1] ([0, 1] with ``allow_zero``)."""
  check_number(path, value, minimum=0, maximum=1, min_open=not allow_zero, fix=fix)


def unwrap_optional(tp):
  """Optional[X] -> X; anything else unchanged."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1:
      return args[0]
  return tp


# --- Moved and removed keys. -------------------------------------------------

# Keys that moved from a section into a sibling of it and that old config files
# (the config.json of committed runs) still hold: (section class name, old key)
# -> (the sibling, the key there). Loading moves the value (:func:`from_dict`;
# the sibling then checks it: a layer kind's options drop another kind's
# option left at its default and refuse one that was set); an override of the
# old key names the new place (:data:`MOVED`).
RELOCATED: dict[tuple[str, str], tuple[str, str]] = {
    # A layer kind's own fields live in its options (moejax.layer's LayerKind.Options).
    ("TopologyConfig", "slots_per_expert"): ("layer_options", "slots_per_expert"),
    ("TopologyConfig", "peer_num_keys"): ("layer_options", "num_keys"),
    ("TopologyConfig", "peer_heads"): ("layer_options", "heads"),
    ("TopologyConfig", "peer_top_k"): ("layer_options", "top_k"),
    ("TopologyConfig", "peer_key_dim"): ("layer_options", "key_dim"),
}

# (config class name, old key) -> where it lives now, relative to that class's
# section (a leading "/" means an absolute path from the experiment root, a
# leading "../" a path from the section's parent), or a sentence explaining
# its removal. Keeps old config files and overrides failing with one line
# that names the new place.
MOVED: dict[tuple[str, str], str] = {
    **{("MoEConfig", k): f"topology.{k}" for k in (
        "num_experts", "expert_width", "expert_widths", "activation", "num_shared_experts",
        "shared_expert_width", "shared_expert_gate", "zero_experts", "copy_experts",
        "constant_experts")},
    **{("MoEConfig", k): f"layer_options.{new}" for (_, k), (_, new) in RELOCATED.items()},
    **{key: f"../{sibling}.{new}" for key, (sibling, new) in RELOCATED.items()},
    ("MoEConfig", "router"): "routing",
    ("MoEConfig", "capacity_factor"): "balance.capacity_factor",
    ("MoEConfig", "drop_priority"): "balance.drop_priority",
    ("MoEConfig", "backend"): "execution.backend",
    ("MoEConfig", "backend_interpret"): "execution.interpret",
    ("ParallelConfig", "gmm_backend"): "/model.moe.execution.backend",
    # A router's own fields live in its options (moejax.routing.spec).
    ("RoutingConfig", "expert_choice_capacity"): "options.capacity (routing.kind='expert_choice')",
    ("RoutingConfig", "top_p"): "options.top_p (routing.kind='top_p')",
    ("RoutingConfig", "n_families"): "options.n_families (routing.kind='hierarchical')",
    ("RoutingConfig", "top_k_families"): "options.top_k_families (routing.kind='hierarchical')",
    ("RoutingConfig", "hash_seed"): "options.seed (routing.kind='hash')",
    # Multi-head latent attention's fields are the options of model.attention='mla'.
    **{("ModelConfig", k): f"attention_options.{k} (with model.attention='mla')" for k in (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    ("ModelConfig", "encoder_layers"): (
        "removed: the model is decoder-only; encoder-decoder presets (Switch) are counted by "
        "the accounting presets (configs/presets/*.py, 'accounting' section)"),
}


def _moved_message(cls_name: str, key: str, where: str) -> Optional[str]:
  new = MOVED.get((cls_name, key))
  if new is None:
    return None
  if new.startswith("removed"):
    return new
  if new.startswith("/"):
    return f"moved to {new[1:]}"
  parent = where.rsplit(".", 1)[0] if "." in where else ""
  if new.startswith("../"):
    new, parent = new[3:], parent.rsplit(".", 1)[0] if "." in parent else ""
  return f"moved to {parent + '.' if parent else ''}{new}"


def moved_hint(dotted: str) -> Optional[str]:
  """For a dotted experiment path that no longer exists, where it went (or None).

  ``moved_hint('model.moe.num_experts')`` -> ``'moved to model.moe.topology.num_experts'``.
  Used by the binaries to turn an override of an old key into one line.
  """
  owners = {"model": "ModelConfig", "moe": "MoEConfig", "parallel": "ParallelConfig",
            "routing": "RoutingConfig", "topology": "TopologyConfig"}
  parts = dotted.split(".")
  if len(parts) >= 2 and parts[-2] in owners:
    return _moved_message(owners[parts[-2]], parts[-1], dotted)
  return None


# --- Dicts, dataclasses and overrides. ---------------------------------------

def from_dict(cls, data: Mapping[str, Any] | None, path: str = ""):
  """Builds dataclass ``cls`` from a nested mapping; unknown keys are errors."""
  if data is None:
    return None
  if dataclasses.is_dataclass(data):
    return data
  if hasattr(data, "to_dict"):  # ml_collections.ConfigDict
    data = data.to_dict()
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  data = _relocate(data, hints, path)
  # A class may build a field from its siblings (routing.options by routing.kind):
  # ``build_field(name, value, data, where)`` (None: not such a field);
  # ``complete(kwargs)`` adds what a built config holds besides the given keys;
  # ``resolved()`` applies knobs that build a new config (granularity). Each
  # returns new values; nothing is set after the fact.
  build_field = getattr(cls, "build_field", None)
  kwargs = {}
  for key, value in data.items():
    where = f"{path}.{key}" if path else key
    if key not in fields:
      moved = _moved_message(cls.__name__, key, where)
      if moved:
        raise ConfigError(where, value, f"no longer a {cls.__name__} field", moved)
      close = difflib.get_close_matches(key, list(fields), n=1)
      fix = f"did you mean {close[0]!r}?" if close else (
          f"valid keys: {', '.join(sorted(fields))}")
      raise ConfigError(where, value, f"unknown key for {cls.__name__}", fix)
    tp = unwrap_optional(hints[key])
    built = build_field(key, value, data, where) if build_field is not None else None
    if built is not None:
      value = built
    elif dataclasses.is_dataclass(tp) and (isinstance(value, Mapping | type(None))
                                         or hasattr(value, "to_dict")):
      value = from_dict(tp, value, where)
    elif isinstance(value, (list, tuple)):
      value = _tuples(value)  # nested too: configs are hashable (jit's static arguments)
    kwargs[key] = value
  complete = getattr(cls, "complete", None)
  obj = cls(**(complete(kwargs) if complete is not None else kwargs))
  resolved = getattr(obj, "resolved", None)
  return resolved() if callable(resolved) else obj


def _relocate(data: Mapping[str, Any], hints: dict, path: str) -> Mapping[str, Any]:
  """``data`` with the :data:`RELOCATED` keys of its sections moved to their siblings.

  A new dict: the caller's mapping (a loaded config.json) is left as it was.
  """
  moves = []
  for key, value in data.items():
    tp = unwrap_optional(hints.get(key))
    if not (dataclasses.is_dataclass(tp) and isinstance(value, Mapping)):
      continue
    moves += [(key, old, *RELOCATED[(tp.__name__, old)]) for old in value
              if (tp.__name__, old) in RELOCATED]
  if not moves:
    return data
  out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
  for section, old, sibling, new in moves:
    value = out[section].pop(old)
    here = f"{path}.{sibling}" if path else sibling
    target = out.get(sibling)
    if target is None:
      target = out[sibling] = {}
    if not isinstance(target, dict):
      raise ConfigError(f"{path}.{section}.{old}" if path else f"{section}.{old}", value,
                        f"moved to {here}.{new}, which is given as {target!r}",
                        f"give {here}.{new} there and remove {section}.{old}")
    if new in target and target[new] != value:
      raise ConfigError(f"{here}.{new}", target[new],
                        f"given together with its old key {section}.{old}={value!r}",
                        f"remove {section}.{old}")
    target[new] = value
  return out


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value





def to_dict(cfg) -> dict:
  """The inverse of :func:`from_dict` (tuples stay tuples)."""
  return dataclasses.asdict(cfg)


def parse_scalar(text: str):
  """``'4'`` -> 4, ``'(1, 2)'`` -> (1, 2), ``'sigmoid'`` -> 'sigmoid'."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def apply_overrides(cfg, overrides: Mapping[str, Any] | list[str]):
  """Returns ``cfg`` with ``{"routing.top_k": 4}`` (or ``["a.b=1"]``) applied.

  The result is validated like any config; a typo in a key is an error, and a
  key that moved names its new place.
  """
  if isinstance(overrides, list):
    pairs = {}
    for item in overrides:
      if "=" not in item:
        raise ConfigError("override", item, "expected key=value",
                          "write e.g. routing.top_k=4")
      k, v = item.split("=", 1)
      pairs[k.strip()] = parse_scalar(v.strip())
    overrides = pairs
  tree = to_dict(cfg)
  for dotted, value in overrides.items():
    node, parts = tree, dotted.split(".")
    owner = type(cfg)
    for i, part in enumerate(parts):
      here = ".".join(parts[: i + 1])
      if not isinstance(node, dict) or part not in node:
        moved = _moved_message(owner.__name__, part, here) if owner else None
        if moved:
          raise ConfigError(here, value, "unknown override key", moved)
        keys = list(node) if isinstance(node, dict) else []
        close = difflib.get_close_matches(part, keys, n=1)
        raise ConfigError(here, value, "unknown override key",
                          f"did you mean {close[0]!r}?" if close else
                          f"valid keys here: {', '.join(sorted(keys))}")
      if i == len(parts) - 1:
        node[part] = value
      else:
        hints = typing.get_type_hints(owner) if owner else {}
        sub = unwrap_optional(hints.get(part)) if part in hints else None
        owner = sub if dataclasses.is_dataclass(sub) else None
        if node[part] is None:
          node[part] = {}
        node = node[part]
  return from_dict(type(cfg), tree)
