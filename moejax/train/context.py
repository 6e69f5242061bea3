"""What the training loop's steps run with (:class:`RunContext`) and how a run may start.

:func:`moejax.train.loop.train` does its read-only checks, takes the
workdir and then hands one frozen :class:`RunContext` to the step loop,
instead of fourteen positional arguments whose order every caller had to
know.

A run that does not start from a random initialisation (fine-tuning) is
the trainer's business only through two small protocols, so that
:mod:`moejax.train` needs nothing of the packages built on it:

- :class:`StartHook`: called with the read-only checks, on every start and
  resume; it checks and describes how the run starts and, for a fresh run,
  returns an :class:`InitialState`. :func:`moejax.finetune.start.finetune_start`
  is the one the binaries pass (it opens and checks the source and prints
  the run's accounting);
- :class:`InitialState`: turns the freshly initialised state into the run's
  first state (:class:`moejax.finetune.source.Source`: the source's weights
  and router state, a new optimizer state).

A config with ``finetune.source`` set and no hook is refused
(:func:`check_start`) rather than silently trained from scratch.

A :class:`Probe` reads a fresh run's first steps back one by one, exactly
as they trained: the results re-check (moejax.results.recheck) records
them with a suite's runs and later re-trains them to compare bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import jax
import optax

from moejax.config import ConfigError
from moejax.train import checkpoint as ckpt_lib
from moejax.train import layer_load
from moejax.train import metrics_log
from moejax.train.config import ExperimentConfig
from moejax.train.layout import DeviceLayout
from moejax.train.safety import RunSafety


class InitialState(Protocol):
  """A fresh run's first state from its initialised one (see the module docstring)."""

  def apply(self, state: Any, tx: optax.GradientTransformation) -> Any:
    """``state`` (a fresh :class:`~moejax.train.step.TrainState`) as the run starts it."""

  def describe(self) -> str:
    """Where the state comes from, for the ``initialised from ...`` line."""


@dataclasses.dataclass
class Probe:
  """The first ``steps`` training steps of a fresh run, read back one by one.

  Each step's metrics (:func:`moejax.train.layer_load.host_row`: loss,
  MaxVio, per-layer loads, ...) are appended to ``rows`` as the step ends;
  reading them back changes nothing the step computes. ``stop``: end the
  run after those steps (a re-check), without evaluating, checkpointing or
  logging them; otherwise the run trains on. ``on_full``: called once with
  the rows when the last of them is in (a suite run writes them beside the
  run then, so a run killed later still has them). A resumed run is not
  probed: its first steps trained in an earlier process.
  """

  steps: int
  stop: bool = False
  on_full: Optional[Callable[[list], None]] = None
  rows: list = dataclasses.field(default_factory=list)

  def after_step(self, step: int, metrics: Any, run_steps: int) -> bool:
    """Records step ``step`` (1-based) of a run of ``run_steps`` if probed; True when the
    run should end here. A run shorter than ``steps`` is probed whole."""
    last = min(self.steps, run_steps)
    if step > last or len(self.rows) != step - 1:
      return False
    self.rows.append(layer_load.host_row(jax.device_get(metrics)))
    if step == last:
      if self.on_full is not None:
        self.on_full(list(self.rows))
      return self.stop
    return False


class StartHook(Protocol):
  """Checks how a run starts; returns its :class:`InitialState` (None: the initialisation).

  Called before anything is written, with the run's config, whether the run
  starts fresh (no checkpoint to resume), the abstract params and optimizer
  (for accounting) and the loop's ``say``. It may raise ConfigError.
  """

  def __call__(self, cfg: ExperimentConfig, *, fresh: bool, abstract_params: Any,
               tx: optax.GradientTransformation,
               say: Callable[[str], None]) -> Optional[InitialState]:
    ...


def check_start(cfg: ExperimentConfig, start: Optional[StartHook]) -> None:
  """ConfigError when ``cfg`` fine-tunes but nothing would load its source."""
  if cfg.finetune.enabled and start is None:
    raise ConfigError("finetune.source", cfg.finetune.source,
                      "names a run to fine-tune, but the trainer was given no start hook to "
                      "load it (moejax.train does not import moejax.finetune)",
                      "run experiments.finetune, or pass "
                      "start=moejax.finetune.start.finetune_start to moejax.train.loop.train")


@dataclasses.dataclass(frozen=True)
class RunContext:
  """Everything the step loop of one run works with, fixed once the workdir is held.

  Attributes:
    cfg: the run's (validated, resolved) experiment config.
    workdir: the run's directory (moejax.train.checkpoint).
    graphdef: the model's static graph (:func:`moejax.train.step.abstract_state`).
    tx: the run's optimizer (:func:`moejax.train.optim.make_optimizer`).
    restored: the checkpoint resumed from (:class:`moejax.train.checkpoint.Restored`),
      or None for a fresh run.
    train_it: the training batch iterator (``moejax.data.make_batches``); its
      position is restored on resume and saved with every checkpoint.
    val_docs: the validation documents (``moejax.data.load_documents``).
    ckpt: the :class:`moejax.train.checkpoint.Checkpointer` of the workdir.
    writer: the :class:`moejax.train.metrics_log.MetricsWriter` of the workdir.
    progress: the :class:`moejax.train.metrics_log.Progress` line.
    say: prints one line of the run's output.
    layout: the :class:`moejax.train.layout.DeviceLayout` (mesh and placement).
    safety: the run's :class:`moejax.train.safety.RunSafety` (asked after every
      step whether a signal ends the run there; checks the rows read back and
      the state before a checkpoint).
    final_eval: ``(params, router_state, other) -> metrics`` replacing the
      trainer's whole-split evaluation at the last step, or None (the
      trainer's own).
    initial: what a fresh run's initialised state becomes (an
      :class:`InitialState` from the :class:`StartHook`; fine-tuning: the
      source), or None (the initialisation itself).
    probe: the :class:`Probe` reading back a fresh run's first steps, or None.
  """

  cfg: ExperimentConfig
  workdir: str
  graphdef: Any
  tx: optax.GradientTransformation
  restored: Optional[ckpt_lib.Restored]
  train_it: Any
  val_docs: Any
  ckpt: ckpt_lib.Checkpointer
  writer: metrics_log.MetricsWriter
  progress: metrics_log.Progress
  say: Callable[[str], None]
  layout: DeviceLayout
  safety: RunSafety
  final_eval: Optional[Callable] = None
  initial: Optional[InitialState] = None
  probe: Optional[Probe] = None
