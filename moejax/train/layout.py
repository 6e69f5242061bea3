"""Where a run's arrays live (:func:`device_layout`) and whether its MoE backend runs here.

Both are read-only checks the trainer does before it writes anything
(:func:`moejax.train.loop.train`), so a run that cannot run fails with one
ConfigError instead of a traceback after the workdir was written.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from moejax.config import ConfigError
from moejax.execution import gmm
from moejax.execution import mesh as mesh_lib
from moejax.execution import parallel as parallel_lib
from moejax.model import ExpertParallel
from moejax.train import checkpoint as ckpt_lib
from moejax.train.config import ExperimentConfig, check_capacity


def check_runnable(cfg: ExperimentConfig) -> None:
  """ConfigError when the MoE execution backend cannot run on this platform as configured.

  A Pallas backend off its platform (``pallas_tpu`` on CPU) needs the
  interpret switch; found here, with the other validation, instead of as a
  traceback at trace time after the workdir was written.
  """
  name = ckpt_lib.field_value(cfg, ckpt_lib.BACKEND_FIELD)
  if cfg.model.moe is None or name not in gmm.backend_names():
    return  # dense, or the reference backend (plain XLA everywhere)
  interpret = bool(ckpt_lib.field_value(cfg, ckpt_lib.BACKEND_INTERPRET_FIELD))
  try:
    gmm.check_available(name, interpret=interpret)
  except gmm.GmmError as e:
    problem, _, fix = str(e).partition(". Fix: ")
    problem = problem.split(": ", 1)[-1]
    fix = fix.replace("pass interpret=True", f"set {ckpt_lib.BACKEND_INTERPRET_FIELD}=True")
    fix = fix.replace("drop interpret=True", f"set {ckpt_lib.BACKEND_INTERPRET_FIELD}=False")
    raise ConfigError(ckpt_lib.BACKEND_FIELD, name, problem,
                      fix.replace("backend=", f"{ckpt_lib.BACKEND_FIELD}=")) from e


class DeviceLayout(NamedTuple):
  """Where the run's arrays live: the model's expert-parallel mesh (or None) and placement.

  ``shardings(tree)``: the NamedSharding of every leaf of a state tree (what
  ``put_state`` places it with, and what a checkpoint is restored into, so
  that every process reads only its own shards).
  """

  expert_parallel: Optional[ExpertParallel]
  put_batch: Callable
  put_state: Callable
  shardings: Callable


def device_layout(cfg: ExperimentConfig) -> DeviceLayout:
  """Checks ``cfg.parallel`` against the devices (no compute) and returns the layout.

  ``parallel.expert == 1`` (the default): data parallelism. Every device of
  every process holds a replica of the state and B / devices rows of each
  batch; ``jax.jit`` partitions the step from these shardings (gradients,
  MoE loads and losses are reduced over the global batch by the
  partitioner). On one device this is plain placement.

  ``parallel.expert > 1``: a ('data', 'fsdp', 'expert') mesh from
  :func:`moejax.execution.mesh.make_mesh`; the batch rows are split over every
  axis, the routed expert weights (and their optimizer moments) over
  'expert' (d over 'fsdp'), everything else is replicated, and the model's
  MoE layers run :func:`moejax.layer.ep_moe_layer` on the mesh.
  """
  pcfg, n = cfg.parallel, jax.device_count()
  try:
    pcfg.axis_sizes(n)  # ConfigError naming the axes when their product is not n
  except ConfigError as e:
    raise _on_processes(e) from None
  check_capacity(cfg, n)  # under expert parallelism a group is one device's rows
  if cfg.data.batch_size % n:
    raise _on_processes(ConfigError(
        "data.batch_size", cfg.data.batch_size,
        f"does not split evenly over the {n} devices of the mesh", f"use a multiple of {n}"))
  if pcfg.expert == 1:
    # Auto axes: the partitioner propagates shardings through the model (the
    # model code has no explicit-sharding annotations).
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                               for k, v in batch.items()}
    shardings = lambda tree: jax.tree.map(lambda _: replicated, tree)
    put_state = lambda state: jax.device_put(state, shardings(state))
    return DeviceLayout(None, put_batch, put_state, shardings)

  moe = cfg.model.moe
  mesh = mesh_lib.make_mesh(pcfg, cfg=moe)
  parallel_lib.resolve_dispatch(pcfg, mesh.devices.flat[0].platform)  # native ragged on CPU
  rows = NamedSharding(mesh, mesh_lib.batch_spec(mesh))
  put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                             for k, v in batch.items()}
  shardings = lambda tree: state_shardings(tree, mesh)
  put_state = lambda state: jax.device_put(state, shardings(state))
  return DeviceLayout(ExpertParallel(mesh, pcfg), put_batch, put_state, shardings)


def _on_processes(e: ConfigError) -> ConfigError:
  """``e`` saying how the devices are spread, on a multi-process run (where the count is
  the global one: every process's local devices)."""
  if jax.process_count() == 1:
    return e
  return ConfigError(e.field, e.value, f"{e.problem} ({jax.process_count()} processes x "
                     f"{jax.local_device_count()} local devices)", e.fix, e.where)


def state_shardings(state, mesh):
  """NamedShardings of a TrainState on an expert-parallel mesh.

  A leaf ``.../experts/<name>`` (the routed expert weights in ``params`` and
  their moments in ``opt_state``) gets the layer's expert spec (E over
  'expert', d over 'fsdp'), so the shard_map inside the step finds its
  inputs in place; every other leaf is replicated.
  """
  def sharding(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    if len(keys) >= 2 and keys[-2] == "experts" and getattr(leaf, "ndim", 0) == 3:
      return NamedSharding(mesh, mesh_lib.expert_param_specs({keys[-1]: None}, mesh)[keys[-1]])
    return NamedSharding(mesh, PartitionSpec())
  return jax.tree_util.tree_map_with_path(sharding, state)
