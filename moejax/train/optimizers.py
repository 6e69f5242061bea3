"""Optimizers as registered ideas, chosen by ``train.optimizer``.

Each optimizer is an :class:`OptimizerSpec` registered in
:data:`moejax.config.registry.OPTIMIZERS`, with its own frozen ``Options``
dataclass (``train.optimizer_options``, checked when the config is built
and shown by ``--print_config``). :func:`moejax.train.optim.make_optimizer`
asks the spec for its transformation and wraps it the same way for every
optimizer: global-norm clipping before it, frozen parameters masked out.

- ``adamw`` (the default): AdamW on the warmup + cosine schedule, weight
  decay on matrices only; ``train.b1``, ``b2``, ``eps``, ``weight_decay``.
- ``muon``: Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers
  in neural networks", kellerjordan.github.io/posts/muon) on the hidden
  matrices, through optax's ``optax.contrib.muon``, and the ``adamw`` above
  on everything else. Which parameters are hidden matrices, and which of
  their axes are the matrix, the model declares
  (:mod:`moejax.topology.roles`): attention and dense projections are
  matrices, an expert stack [E, d, f] is E matrices orthogonalised one by
  one (dimension numbers whose batch axis is E), and a gated stack's
  [E, d, 2f] ``w_gate_up`` is 2E matrices (its role has ``output_blocks=2``:
  Muon sees it as [E, d, 2, f], W_gate and W_up each orthogonalised and
  scaled as the [d, f] matrix it is); embeddings, the head,
  norms, routers, gates and LoRA adapters are AdamW's. The router's
  selection bias is router state, never a parameter, so no optimizer sees it.

Muon's update of an [A, B] matrix (Liu et al. 2025, "Muon is Scalable for
LLM Training", arXiv 2502.16982, eq. 3-4): momentum M of the gradients G
(Nesterov: the update reads mu M + G; optax keeps M as a bias-corrected
average, which Newton-Schulz's normalisation makes the same direction),
O = NewtonSchulz(M) ~ U V^T, and

    W <- W - lr (0.2 sqrt(max(A, B)) O + wd W)

The 0.2 sqrt(max(A, B)) factor (``consistent_rms``) gives the update the
RMS of a typical AdamW update, so Muon uses AdamW's learning rate, schedule
and decoupled weight decay unchanged (their recipe; ``learning_rate`` /
``weight_decay`` override them). ``consistent_rms=None`` is Jordan's scaling
sqrt(max(1, B / A)), which wants a larger learning rate of its own (0.02-0.05).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import optax
import optax.contrib

from moejax.config import ConfigError, check_count, check_number, check_positive
from moejax.config.registry import OPTIMIZERS
from moejax.topology.roles import ParamRole

if TYPE_CHECKING:
  from moejax.train.config import TrainConfig

OPTIONS_FIELD = "train.optimizer_options"
# path (keys) -> ParamRole: the model's declaration (moejax.model.param_role_tree).
RoleAt = Callable[[tuple], ParamRole]


def schedule(cfg: "TrainConfig", peak: Optional[float] = None) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to peak * min_lr_ratio at steps
  (peak: ``cfg.learning_rate`` unless given)."""
  peak = cfg.learning_rate if peak is None else peak
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.steps, end_value=peak * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrices (ndim >= 2), not scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def adamw(cfg: "TrainConfig") -> optax.GradientTransformation:
  """AdamW on :func:`schedule` with ``train``'s moments, eps and matrix-only weight decay."""
  return optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=decay_mask)


class OptimizerSpec:
  """An optimizer: its options and how it updates the parameters.

  Capabilities: ``needs_roles``: the transformation reads the model's
  parameter roles (:mod:`moejax.topology.roles`), so building it needs the
  model config.
  """

  name = ""
  Options: type = None
  needs_roles = False

  def transform(self, cfg: "TrainConfig", role_at: Optional[RoleAt]
                ) -> optax.GradientTransformation:
    """The update rule (without clipping or frozen masking, which the trainer adds)."""
    raise NotImplementedError

  def describe(self, cfg: "TrainConfig") -> str:
    """One line naming the optimizer and its options (for budget tables and logs)."""
    opts = ", ".join(f"{f.name}={getattr(cfg.opts, f.name)}"
                     for f in dataclasses.fields(cfg.opts))
    return f"{self.name}({opts})" if opts else self.name

  def __repr__(self) -> str:
    return f"<optimizer {self.name!r} ({type(self).__module__}.{type(self).__name__})>"


def register(spec: OptimizerSpec) -> OptimizerSpec:
  """Registers an optimizer (an instance); a name already registered is an error."""
  return OPTIMIZERS.register(spec)


@dataclasses.dataclass(frozen=True)
class AdamWOptions:
  """AdamW has no options of its own: it reads ``train.b1``, ``b2``, ``eps`` and
  ``weight_decay`` (which Muon's AdamW half reads too)."""


class AdamW(OptimizerSpec):
  """AdamW (Loshchilov & Hutter 1711.05101) on every parameter."""

  name = "adamw"
  Options = AdamWOptions

  def transform(self, cfg, role_at):
    return adamw(cfg)


@dataclasses.dataclass(frozen=True)
class MuonOptions:
  """Muon's options (``train.optimizer_options`` with ``train.optimizer='muon'``).

  Attributes:
    momentum: Muon's momentum mu (0.95 in both papers).
    nesterov: Nesterov momentum (both papers).
    ns_steps: Newton-Schulz iterations (5 in both papers).
    consistent_rms: the update is scaled by consistent_rms * sqrt(max(A, B))
      (Liu et al.'s 0.2 matches AdamW's update RMS, so AdamW's learning rate
      and weight decay apply); None: Jordan's sqrt(max(1, B / A)).
    learning_rate: Muon's peak learning rate on the same warmup + cosine
      schedule (None: ``train.learning_rate``).
    weight_decay: Muon's decoupled weight decay, multiplied by the learning
      rate as in AdamW (None: ``train.weight_decay``).
  """

  momentum: float = 0.95
  nesterov: bool = True
  ns_steps: int = 5
  consistent_rms: Optional[float] = 0.2
  learning_rate: Optional[float] = None
  weight_decay: Optional[float] = None

  def __post_init__(self):
    p = OPTIONS_FIELD
    check_number(f"{p}.momentum", self.momentum, minimum=0, maximum=1, max_open=True,
                 fix="use 0.95 (Jordan et al.; Liu et al.)")
    if not isinstance(self.nesterov, bool):
      raise ConfigError(f"{p}.nesterov", self.nesterov, "must be True or False",
                        f"set {p}.nesterov=True")
    check_count(f"{p}.ns_steps", self.ns_steps, minimum=1)
    if self.consistent_rms is not None:
      check_positive(f"{p}.consistent_rms", self.consistent_rms)
    if self.learning_rate is not None:
      check_positive(f"{p}.learning_rate", self.learning_rate)
    if self.weight_decay is not None:
      check_positive(f"{p}.weight_decay", self.weight_decay, allow_zero=True)


def path_keys(path) -> tuple:
  """The dict keys (and sequence indices) of a jax key path."""
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def labels(tree: Any, role_at: RoleAt) -> Any:
  """'muon' on the leaves of ``tree`` whose role is a matrix, 'adamw' elsewhere."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "muon" if role_at(path_keys(path)).matrix else "adamw", tree)


def dimension_numbers(tree: Any, role_at: RoleAt) -> Any:
  """optax's MuonDimensionNumbers for each leaf of ``tree`` (all matrices, seen in blocks:
  :func:`in_blocks`): its declared reduction and output axes; every other axis (E of an
  expert stack, the block axis of a gate|up stack) is a batch axis."""
  def dims(path, _):
    role = role_at(path_keys(path))
    output = role.output if role.output_blocks == 1 else tuple(a + 1 for a in role.output)
    return optax.contrib.MuonDimensionNumbers(reduction_axis=role.reduction,
                                              output_axis=output)
  return jax.tree_util.tree_map_with_path(dims, tree)


def _block_view(tree: Any, role_at: RoleAt, split: bool) -> Any:
  """Leaves whose role has n = output_blocks > 1: [..., n o] -> [..., n, o] (``split``)
  or back. The output axis must be the last one (checked)."""
  def view(path, leaf):
    role = role_at(path_keys(path))
    n = role.output_blocks
    if n == 1:
      return leaf
    if split:
      if role.output != (leaf.ndim - 1,) or leaf.shape[-1] % n:
        raise ValueError(f"{'/'.join(map(str, path_keys(path)))}: {n} output blocks need "
                         f"the last axis as output and divisible by {n}, got shape "
                         f"{leaf.shape}, output axes {role.output}. Fix: declare "
                         "output_blocks only on a [..., in, n * out] weight")
      return leaf.reshape(leaf.shape[:-1] + (n, leaf.shape[-1] // n))
    return leaf.reshape(leaf.shape[:-2] + (-1,))
  return jax.tree_util.tree_map_with_path(view, tree)


def in_blocks(inner: optax.GradientTransformation,
              role_at: RoleAt) -> optax.GradientTransformation:
  """``inner`` run on the parameters seen in their declared output blocks (a gate|up stack
  [E, d, 2f] as [E, d, 2, f]); its updates come back in the stored shapes."""
  def init(params):
    return inner.init(_block_view(params, role_at, True))

  def update(updates, state, params=None):
    seen = None if params is None else _block_view(params, role_at, True)
    out, state = inner.update(_block_view(updates, role_at, True), state, seen)
    return _block_view(out, role_at, False), state
  return optax.GradientTransformation(init, update)


class Muon(OptimizerSpec):
  """Muon on the declared hidden matrices, AdamW on the rest (see the module docstring)."""

  name = "muon"
  Options = MuonOptions
  needs_roles = True

  def transform(self, cfg, role_at):
    if role_at is None:
      raise ValueError("train.optimizer='muon' needs the model's parameter roles. Fix: pass "
                       "the model config to moejax.train.optim.make_optimizer")
    o = cfg.opts
    wd = cfg.weight_decay if o.weight_decay is None else o.weight_decay
    # Only matrices reach this branch (the partition below), so optax's own
    # AdamW half of contrib.muon receives nothing: the rest gets moejax's
    # AdamW, exactly as train.optimizer='adamw' runs it (optax's half would
    # use Nesterov momentum and decay the norm scales).
    muon = in_blocks(optax.contrib.muon(
        schedule(cfg, o.learning_rate), ns_steps=o.ns_steps, beta=o.momentum,
        weight_decay=wd, nesterov=o.nesterov, consistent_rms=o.consistent_rms,
        muon_weight_dimension_numbers=lambda tree: dimension_numbers(tree, role_at)),
        role_at)
    return optax.partition({"muon": muon, "adamw": adamw(cfg)},
                           lambda tree: labels(tree, role_at))


for _spec in (AdamW(), Muon()):
  register(_spec)
