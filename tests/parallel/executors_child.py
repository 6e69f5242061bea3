"""Child of test_executors.py: a registered expert-parallel executor against ReferenceExecutor.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/parallel/executors_child.py NAME...``
with NAMEs registered dispatch units (one ``OK``/``FAILED`` line each,
tests/parallel/children.py). For every transport this platform
runs, the executor :func:`moejax.execution.parallel.prepare` builds is
called directly under ``shard_map`` (no router, no layer) on a fixed
routing and must equal ``ReferenceExecutor`` on the whole batch: outputs
and gradients with respect to the expert weights, the tokens and the gate
weights. Two cases, one jit each: dropless with a placement that
replicates two experts (S_p = 3), and capacity C = 1 (routing already
within it, as the layer hands it over).
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from moejax import config as C  # noqa: E402
from moejax import layer as L  # noqa: E402
from moejax.execution import executor as executor_lib  # noqa: E402
from moejax.execution import mesh as mesh_lib  # noqa: E402
from moejax.execution import parallel  # noqa: E402
from moejax.execution import placement as placement_lib  # noqa: E402
from moejax.execution import registry  # noqa: E402
from moejax.routing.types import RoutingResult  # noqa: E402
from tests.configs import moe_config  # noqa: E402
from tests.parallel import children  # noqa: E402
from tests.parallel import ep_common as H  # noqa: E402

N, E, T, K, DM = 8, 8, 4, 2, 8  # devices, FFN experts, tokens per device, slots, width
ZERO = 1                         # one zero-computation expert (id E): never sent

# The ParallelConfig fields that resolve to each transport.
TRANSPORT_CONFIG = {"capacity": dict(dispatch="capacity"),
                    "ragged_native": dict(dispatch="ragged", ragged_impl="native"),
                    "ragged_emulated": dict(dispatch="ragged", ragged_impl="emulated")}


def routing(seed: int, capacity=None) -> RoutingResult:
  """[N T, K] distinct experts per token, ~1/4 of slots invalid, C per (device, expert)."""
  rng = np.random.default_rng(seed)
  ids = np.argsort(rng.random((N * T, E + ZERO)), axis=1)[:, :K].astype(np.int32)
  valid = rng.random((N * T, K)) < 0.75
  if capacity is not None:  # keep the first C copies per (device, expert), slot-major
    for dev in range(N):
      seen = {}
      for k in range(K):
        for t in range(dev * T, (dev + 1) * T):
          if valid[t, k]:
            seen[ids[t, k]] = seen.get(ids[t, k], 0) + 1
            valid[t, k] = seen[ids[t, k]] <= capacity
  weights = np.where(valid, rng.random((N * T, K)), 0).astype(np.float32)
  probs = jnp.full((N * T, E + ZERO), 1.0 / (E + ZERO))
  return RoutingResult(jnp.asarray(np.where(valid, ids, 0)), jnp.asarray(weights),
                       jnp.asarray(valid), probs, jnp.log(probs))


def objective(y):
  return jnp.sum(jnp.sin(y))


_REFERENCE = {}


def reference(cfg, experts, x, result, case: str):
  """(y, grads) of ReferenceExecutor on the whole batch, once per case (shared by transports)."""
  if case in _REFERENCE:
    return _REFERENCE[case]
  ref = executor_lib.ReferenceExecutor(E, cfg.topology.activation)

  def loss(e, x, w):
    y, _ = ref(e, x, result.replace(weights=w))
    return objective(y), y
  (_, y), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(experts, x, result.weights)
  _REFERENCE[case] = y, g
  return y, g


def expert_parallel(cfg, pcfg, experts, x, result, *, capacity, placement):
  """(y, grads, dropped, executor) of the prepared executor called under shard_map."""
  mesh = mesh_lib.make_mesh(pcfg, cfg=cfg)
  built = {}

  def loss(e, x, w):
    prep = parallel.prepare({"experts": e}, cfg, mesh, pcfg, x.shape[0], DM,
                            placement=placement)
    ex = built["executor"] = prep.executor

    def body(params, xs, res):
      y, extras = ex(params["experts"], xs, res, width_mask=None, capacity=capacity)
      return y, extras["comm"]["transport_dropped"]
    y, dropped = jax.shard_map(body, mesh=mesh,
                               in_specs=(prep.param_specs, prep.token_spec, prep.token_spec),
                               out_specs=(prep.token_spec, P()), check_vma=False)(
                                   prep.params, x, result.replace(weights=w))
    return objective(y), (y, dropped)
  fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
  (_, (y, dropped)), g = fn(experts, x, result.weights)
  return y, g, int(dropped), built["executor"]


def check(name: str, transport: str, cfg, experts, x):
  load = np.array([9.0, 7, 1, 1, 1, 1, 1, 1])
  replicated = placement_lib.compute_placement(load, 4, slots_per_device=3)
  assert replicated.num_replicas.max() > 1
  # Two buckets where the step's maximum is below the worst case (dropless),
  # one (no switch, less to compile) under capacity.
  for label, cap, plc, buckets in (("dropless+replicas", None, replicated, 2),
                                   ("capacity", 1, None, 1)):
    pcfg = C.ParallelConfig(data=2, expert=4, devices_per_node=2, dispatch_unit=name,
                            capacity_buckets=buckets, **TRANSPORT_CONFIG[transport])
    result = routing(seed=1 if cap else 0, capacity=cap)
    y0, g0 = reference(cfg, experts, x, result, label)
    y, g, dropped, ex = expert_parallel(cfg, pcfg, experts, x, result, capacity=cap,
                                        placement=plc)
    what = f"{name} {transport} {label}"
    assert type(ex) is registry.EXECUTORS.get(name), (what, type(ex))
    assert type(ex.transport) is registry.TRANSPORTS.get(transport), (what, ex.transport)
    assert dropped == 0, what
    H.close(y, y0, f"{what} y")
    H.close_tree(g, g0, f"{what} grad (experts, x, gate weights)")
    print("  ok", what, flush=True)


def main(argv):
  assert len(jax.devices()) == N, f"need {N} devices, got {jax.devices()}"
  platform = jax.devices()[0].platform
  cfg = moe_config(num_experts=E, expert_width=8, backend="reference", zero_experts=ZERO,
                   routing=dict(top_k=K))
  kx, ke = jax.random.split(jax.random.PRNGKey(0))
  experts = L.init_moe_params(ke, DM, cfg)["experts"]
  x = jax.random.normal(kx, (N * T, DM), jnp.float32)

  def check_every_transport(name):
    for transport in registry.TRANSPORTS.names():
      allowed = registry.TRANSPORTS.get(transport).platforms
      if allowed is None or platform in allowed:
        check(name, transport, cfg, experts, x)
  names = argv[1:]
  return children.run_groups({n: lambda n=n: check_every_transport(n) for n in names}, names)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
