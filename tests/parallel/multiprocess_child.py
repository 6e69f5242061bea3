"""One of the processes of test_multiprocess.py: the layer across processes (gloo on CPU).

Run as ``JAX_NUM_CPU_DEVICES=4 python multiprocess_child.py PROCESS_ID NUM_PROCESSES PORT``.
Every process builds the same inputs from the same seeds, places them on the
global mesh (expert axis over all 8 devices of both processes, so the
all_to_all crosses processes; nodes = processes), runs the expert-parallel
layer and checks the shards it holds against the single-device reference it
computes itself. Prints ``OK <pid>``.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main(pid: int, nproc: int, port: int):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                             process_id=pid, initialization_timeout=120)
  try:
    run(pid)
  finally:
    jax.distributed.shutdown()


def run(pid):
  from moejax import config as C
  from moejax import layer as L
  from moejax.execution import mesh as mesh_lib
  from tests.parallel import ep_common as H

  assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
  cfg = H.make_cfg("deepseek_v3")
  pcfg = C.ParallelConfig(data=1, expert=8)
  mesh = mesh_lib.make_mesh(pcfg, cfg=cfg)
  node_of = mesh_lib.nodes_of_expert_axis(mesh, None)
  np.testing.assert_array_equal(node_of, [0, 0, 0, 0, 1, 1, 1, 1])

  params, x, ids = jax.tree.map(np.asarray, H.inputs(cfg))
  state = L.init_router_state(cfg)
  state = jax.tree.map(np.asarray, state.replace(
      bias=np.linspace(-0.2, 0.2, cfg.num_routed, dtype=np.float32)))
  y0, st0, aux0, g0 = jax.tree.map(np.asarray, H.full_fn(cfg, train=True)(params, x, ids, state))

  def put(value, spec):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda idx: value[idx])

  specs = mesh_lib.param_specs(params, mesh)
  gparams = jax.tree.map(put, params, specs)
  batch = mesh_lib.batch_spec(mesh)
  gx, gids = put(x, batch), put(ids, batch)
  gstate = jax.tree.map(lambda v: put(v, P()), state)
  y, st, aux, g = H.ep_fn(cfg, mesh, pcfg, train=True)(gparams, gx, gids, gstate)

  def check(got, want, what):
    shards = got.addressable_shards
    assert shards, what
    for shard in shards:
      H.close(np.asarray(shard.data), want[shard.index], what)

  check(y, y0, "y")
  jax.tree.map(lambda a, b: check(a, b, "grad"), g, g0)
  jax.tree.map(lambda a, b: check(a, b, "router state"), st, st0)
  check(aux.load, aux0.load, "load")
  check(aux.metrics.max_vio, aux0.metrics.max_vio, "max_vio")
  cross = float(np.asarray(aux.execution["comm"]["copies_cross_node"].addressable_shards[0].data))
  assert cross > 0, "no bytes crossed processes: the check is vacuous"
  print(f"OK {pid} cross-process bytes {cross:.0f}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
