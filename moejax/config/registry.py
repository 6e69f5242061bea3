"""The names every config field may take, and the registries of ideas.

Two kinds of name live here:

- closed choices (score functions, gating conventions, ...): tuples, checked
  by :func:`moejax.config.core.check_choice`;
- open registries of *ideas* (:class:`Registry`): router kinds and layer kinds
  are objects registered by name. Each carries its typed options and its
  capabilities, and config rules, accounting, serving, fine-tuning and
  interop ask the object (``spec.supports_bias``) instead of comparing a kind
  with a string. The shipped ideas register through the same public
  :meth:`Registry.register` a researcher's own module calls
  (``moejax.routing.register``); the modules that ship them are imported the
  first time a registry is read, so a config naming ``kind='topk'`` finds it
  without the caller importing the routing plane first.

This module imports only :mod:`moejax.config.core`; reading a registry imports
the package that ships its ideas (the routing plane for routers), which is the
one way the config learns what a kind can do.
"""

import dataclasses
import difflib
import importlib
import sys
from typing import Any, Iterator

from moejax.config.core import ConfigError, check_choice


class RegistryError(ValueError):
  """A name registered twice, or an object that cannot be registered."""


class UnknownNameError(KeyError):
  """``registry[name]`` of a name nobody registered; the message is one line with the fix."""

  def __str__(self) -> str:  # KeyError would show the message in quotes
    return str(self.args[0])


class Registry:
  """Ideas of one kind (routers, layer kinds, ...) by name.

  ``builtins`` are the modules whose import registers the shipped ideas;
  they are imported on the first read (or registration), so a name taken by a
  shipped idea can never be registered again by a plugin imported earlier.
  """

  def __init__(self, what: str, field: str = "", builtins: tuple[str, ...] = (),
               fix: str = ""):
    self.what, self.field, self.fix = what, field, fix
    self._builtins, self._items, self._origin = builtins, {}, {}
    self._state = "new"  # new -> loading -> loaded

  def _load(self) -> None:
    if self._state != "new":
      return
    self._state = "loading"
    try:
      for module in self._builtins:
        importlib.import_module(module)
    except BaseException:
      self._state = "new"
      raise
    self._state = "loaded"

  def register(self, obj: Any, module: str = "") -> Any:
    """Adds ``obj`` under ``obj.name``; a name already taken is a :class:`RegistryError`.

    ``module``: the module the idea comes from, when it is not the module of
    ``obj``'s class (a loss function wrapped in the shipped ``BalanceLoss``
    comes from the module that defines the function); what a run's
    provenance records. Returns ``obj``, so it can decorate a class
    instance's creation.
    """
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
      raise RegistryError(f"a {self.what} needs a `name` that is a Python identifier, got "
                          f"{name!r} on {_qualname(obj)}. Fix: set name = 'my_"
                          f"{self.what.replace(' ', '_')}'")
    self._load()
    if name in self._items:
      raise RegistryError(
          f"{self.what} {name!r} is already registered (by {self._origin[name]}."
          f"{_qualname(self._items[name])}); {module or _module_of(obj)}.{_qualname(obj)} "
          f"cannot take the name. Fix: give your {self.what} another name")
    self._items[name] = obj
    self._origin[name] = module or _module_of(obj)
    return obj

  def swap(self, obj: Any) -> Any:
    """Puts ``obj`` in place of the idea registered under ``obj.name``; returns that one.

    For tests and notebooks that vary a shipped idea (``dataclasses.replace`` of
    it) and put the original back afterwards; the provenance stays the original's.
    """
    old = self.get(obj.name)
    self._items[obj.name] = obj
    return old

  def unregister(self, name: str) -> None:
    """Removes a registered idea (tests that register a plugin clean up with it)."""
    self._items.pop(name, None)
    self._origin.pop(name, None)

  def get(self, name: Any, field: str = "") -> Any:
    """The idea named ``name``; ConfigError (``field``, default the registry's) otherwise."""
    self._load()
    if isinstance(name, str) and name in self._items:
      return self._items[name]
    try:
      check_choice(field or self.field or self.what, name, self.names())
    except ConfigError as e:
      fix = str(e).split('Fix: ', 1)[1] + (f"; {self.fix}" if self.fix else "")
      raise ConfigError(e.field, name, f"no {self.what} of that name is registered",
                        fix) from None
    raise AssertionError("unreachable")

  def __getitem__(self, name: str) -> Any:
    """``ROUTERS['topk']``: the idea named ``name`` (a name -> idea mapping).

    An unknown name raises :class:`UnknownNameError` (a KeyError) whose
    message is :meth:`get`'s one line: the close names and how to register one.
    """
    try:
      return self.get(name)
    except ConfigError as e:
      raise UnknownNameError(str(e)) from None

  def keys(self) -> tuple:
    return self.names()

  def values(self) -> tuple:
    return tuple(self.get(n) for n in self.names())

  def items(self) -> tuple:
    return tuple((n, self.get(n)) for n in self.names())

  def names(self) -> tuple:
    self._load()
    return tuple(self._items)

  def origin(self, name: str) -> str:
    """The module that registered ``name`` (what a run's provenance records)."""
    self._load()
    return self._origin[name]

  def plugins(self) -> dict[str, str]:
    """name -> registering module, for the ideas registered from outside ``moejax``."""
    self._load()
    return {n: m for n, m in self._origin.items() if not _is_shipped(m)}

  def __contains__(self, name: object) -> bool:
    self._load()
    return name in self._items

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __len__(self) -> int:
    return len(self.names())


def _module_of(obj: Any) -> str:
  """The module that defines ``obj`` (an instance's class, or a class itself)."""
  return obj.__module__ if isinstance(obj, type) else type(obj).__module__


def _qualname(obj: Any) -> str:
  return (obj if isinstance(obj, type) else type(obj)).__qualname__


def _is_shipped(module: str) -> bool:
  return module == "moejax" or module.startswith("moejax.")


def module_file(module: str) -> str:
  """The source file of an imported module ('' when it has none)."""
  mod = sys.modules.get(module)
  return getattr(mod, "__file__", "") or ""


# Routing plane: router kinds (moejax.routing.spec.RouterSpec objects).
ROUTERS = Registry("router", "moe.routing.kind", ("moejax.routing",),
                   "a router of your own is registered with moejax.routing.register("
                   "MyRouter()) in a module your config file imports")
SCORE_FNS = ("softmax", "sigmoid", "sqrtsoftplus")
GATINGS = ("topk_softmax", "scores", "normalized")
GROUP_SCORES = ("auto", "top2_sum", "max")
ROUTER_DTYPES = ("float32", "bfloat16", "float16")

# Balance plane: balance losses and bias-controller rules
# (moejax.balance.rules.BalanceLoss / BiasRule objects).
BALANCE_LOSSES = Registry("balance loss", "moe.balance.extra_losses", ("moejax.balance",),
                          "a loss of your own is registered with "
                          "@moejax.balance.register_loss('name') in a module your config imports")
BIAS_RULES = Registry("bias rule", "moe.balance.bias_update", ("moejax.balance",),
                      "a rule of your own is registered with "
                      "@moejax.balance.register_bias_rule('name') in a module your config "
                      "imports")
# Each balance loss in the objective is logged (metrics.jsonl, TensorBoard, the suite
# summary) under this prefix and its registered name: ``balance/z_loss``.
BALANCE_LOSS_LOG_PREFIX = "balance/"
AUX_SCOPES = ("batch", "sequence", "global")
AUX_CONVENTIONS = ("switch", "topk")
DROP_PRIORITIES = ("position", "score")

# Layer kinds (sparse, soft, peer: moejax.layer's LayerKind objects).
LAYERS = Registry("layer kind", "moe.kind", ("moejax.layer",),
                  "a layer kind of your own is registered with moejax.layer.register_kind("
                  "MyKind()) in a module your config file imports")

# Training: optimizers (moejax.train.optimizers.OptimizerSpec objects), chosen by
# train.optimizer with their own options in train.optimizer_options.
OPTIMIZERS = Registry("optimizer", "train.optimizer", ("moejax.train.optimizers",),
                      "an optimizer of your own is registered with moejax.train.optimizers."
                      "register(MyOptimizer()) in a module your config file imports")

# Model: attention kinds (moejax.nn.attention_kinds.AttentionSpec objects), chosen by
# model.attention with their own options in model.attention_options.
ATTENTIONS = Registry("attention kind", "model.attention", ("moejax.nn.attention_kinds",),
                      "an attention kind of your own is registered with moejax.nn."
                      "attention_kinds.register(MyAttention()) in a module your config file "
                      "imports")

# Topology plane.
ACTIVATIONS = ("swiglu", "gelu")

# Execution plane. Grouped-matmul backends are moejax.execution.gmm.Backend
# objects registered in GMM_KERNELS (a kernel of your own registers the same
# way, from its own module); ``reference`` is the layer-level oracle that runs
# every expert on every token; ``auto`` (the default) is resolved to the
# fastest backend verified on the platform (moejax.execution.gmm.resolve_backend,
# which needs JAX and so is not here). GMM_BACKENDS names the shipped ones
# without importing them (ragged_dot, the reference, first).
GMM_BACKENDS = ("ragged_dot", "blocked", "pallas_tpu", "pallas_gpu", "whole_group")
GMM_KERNELS = Registry("grouped-matmul backend", "moe.execution.backend",
                       ("moejax.execution.gmm", "moejax.execution.blocked",
                        "moejax.execution.pallas_tpu", "moejax.execution.pallas_gpu",
                        "moejax.execution.whole_group"),
                       "a kernel of your own is a moejax.execution.gmm.Backend registered "
                       "with moejax.execution.gmm.register_backend(...) in a module your "
                       "config imports")
AUTO_BACKEND = "auto"
EXPERT_BACKENDS = (AUTO_BACKEND, "reference") + GMM_BACKENDS


def gmm_backend_names() -> tuple:
  """Every registered grouped-matmul backend: the shipped ones in GMM_BACKENDS' order,
  then the plugins' in registration order (imports the execution plane)."""
  names = GMM_KERNELS.names()
  return tuple(n for n in GMM_BACKENDS if n in names) + tuple(
      n for n in names if n not in GMM_BACKENDS)


def expert_backend_names() -> tuple:
  """What ``moe.execution.backend`` may name: auto, reference and every gmm backend."""
  return (AUTO_BACKEND, "reference") + gmm_backend_names()


DISPATCHES = ("capacity", "ragged")
# Executors, the one registry of how a layer's routed experts are computed: the
# single-device ones (grouped, reference; moejax.execution.executor), chosen by
# moe.execution.executor, and the expert-parallel ones by dispatch unit (token,
# copy, node; moejax.execution.dispatch), chosen by parallel.dispatch_unit. A
# class says which it is (``expert_parallel``). Transport classes (padded
# capacity, native and emulated ragged; moejax.execution.transport) are their own.
EXECUTORS = Registry("executor", "parallel.dispatch_unit",
                     ("moejax.execution.executor", "moejax.execution.dispatch"),
                     "an executor of your own is a class decorated with "
                     "@moejax.execution.registry.register_executor (one device) or "
                     "register_dispatch (expert-parallel) in a module your config imports")
LOCAL_EXECUTOR = "grouped"  # moe.execution.executor's default


def executor_names(expert_parallel: bool) -> tuple:
  """The registered executors of one side: expert-parallel dispatch units, or single-device."""
  return tuple(n for n in EXECUTORS.names()
               if getattr(EXECUTORS.get(n), "expert_parallel", True) == expert_parallel)


def check_executor(field: str, name: str, expert_parallel: bool) -> None:
  """ConfigError unless ``name`` is a registered executor of the side ``field`` chooses."""
  names = executor_names(expert_parallel)
  if name in names:
    return
  side = "expert-parallel" if expert_parallel else "single-device"
  if name in EXECUTORS:
    raise ConfigError(field, name, f"is not {'an' if expert_parallel else 'a'} {side} executor",
                      f"use one of {', '.join(names)}")
  try:
    check_choice(field, name, names)
  except ConfigError as e:
    fix = str(e).split("Fix: ", 1)[1]
    raise ConfigError(field, name, f"no {side} executor of that name is registered",
                      f"{fix}; {EXECUTORS.fix}") from None


TRANSPORTS = Registry("expert-parallel transport", "parallel.dispatch",
                      ("moejax.execution.transport",))
RAGGED_IMPLS = ("auto", "native", "emulated")
ROUTE_LIMITS = ("none", "nodes", "devices")

# Model.
MOE_LAYOUTS = ("all", "every_other", "first_dense")
MOE_SCHEDULES = ("serial", "scmoe")
DENSE_TWINS = ("none", "active", "total")
MTP_FFNS = ("dense", "moe")
COMPUTE_DTYPES = ("float32", "bfloat16")
MOD_GATES = ("sigmoid", "raw")


# Option classes of every registered idea, searched when a key is unknown for
# the kind in use (a field of another router's options names that router).
def _owners_of(key: str, registry: Registry) -> list[tuple[str, Any]]:
  out = []
  for name in registry.names():
    opts = registry.get(name).Options
    for f in dataclasses.fields(opts):
      if f.name == key:
        out.append((name, f.default))
  return out


def options_from_dict(cls, data: Any, path: str, registry: Registry = ROUTERS,
                      kind_field: str = "routing.kind"):
  """An idea's options dataclass from a mapping.

  A key of another kind's options is refused naming that kind, unless it has
  that kind's default value (then it was not set: switching ``routing.kind``
  on the command line leaves the old kind's defaults in the tree).
  ``registry`` / ``kind_field``: the ideas whose options these are (routers
  by default; optimizers: ``OPTIMIZERS``, ``'train.optimizer'``).
  """
  if hasattr(data, "to_dict"):
    data = data.to_dict()
  own = {f.name for f in dataclasses.fields(cls)}
  kept = {}
  for key, value in data.items():
    if key in own:
      kept[key] = tuple(value) if isinstance(value, list) else value
      continue
    owners = _owners_of(key, registry)
    if owners and all(value == default for _, default in owners):
      continue
    where = f"{path}.{key}"
    if owners:
      kinds = ", ".join(repr(n) for n, _ in owners)
      raise ConfigError(where, value, f"is an option of {kind_field}={kinds}, not of this "
                        f"kind ({cls.__name__})",
                        f"remove {key} or set {kind_field}={owners[0][0]!r}")
    close = difflib.get_close_matches(key, sorted(own), n=1)
    raise ConfigError(where, value, f"unknown option for {cls.__name__}",
                      f"did you mean {close[0]!r}?" if close else
                      f"valid options: {', '.join(sorted(own)) or 'none'}")
  return cls(**kept)
