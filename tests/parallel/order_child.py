"""Child process of test_collective_order.py: the EP bench's step on 8 simulated CPU devices.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/parallel/order_child.py GROUP [CALLS]``:

* ``default CALLS``: the compiled step of the default dispatch
  (``ep_capacity``) has no collective inside control flow on CPU, and CALLS
  calls of it in a row, each waited for as the bench does, finish (a hang
  aborts at XLA's rendezvous termination timeout).
* ``all CALLS``: the same for every bucketed variant of the bench, and the
  default step built with the bucket switch on (what GPU/TPU compile) has a
  nested all_to_all that the next collective does not depend on: the pattern
  XLA:CPU's runtime may run out of order (moejax.execution.collective_order),
  i.e. what this code compiled to on CPU before the switch was turned off;
  one call of it equals the CPU step bit for bit.

Prints ``OK <group>`` and exits 0 when every check holds.
"""

import functools
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments.benchmarks import ep as bench_ep  # noqa: E402
from moejax import layer as L  # noqa: E402
from moejax.execution import collective_order  # noqa: E402
from moejax.execution import mesh as mesh_lib  # noqa: E402
from moejax.execution import transport  # noqa: E402

# The bench's variants (experiments/benchmarks/ep.py) at a tiny size: the program's
# structure (collectives, switches) does not depend on it, compile time does.
B, S, DM = 16, 8, 16
BUCKETED = ("ep_capacity", "ep_capacity_copy", "ep_capacity_cf", "ep_ragged",
            "ep_node_limited")


@functools.lru_cache(maxsize=None)
def compiled_step(name: str):
  """(compiled value_and_grad of the bench's loss for variant ``name``, its args)."""
  cfg, variants = bench_ep._variants("coarse")
  vcfg, pcfg = variants[name]
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  params = L.init_moe_params(k[0], DM, cfg)
  x = jax.random.normal(k[1], (B, S, DM), jnp.float32)
  cot = jax.random.normal(k[2], (B, S, DM), jnp.float32)
  mesh = mesh_lib.make_mesh(pcfg, jax.devices()[:pcfg.expert], cfg=vcfg)

  def loss(p, x):
    y, aux = L.ep_moe_layer(p, x, None, vcfg, mesh, pcfg)
    return jnp.vdot(y, cot) + aux.losses["total"], aux

  args = (mesh_lib.shard_params(params, mesh), mesh_lib.shard_batch(x, mesh))
  return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(*args).compile(), args


def check_structure(names, with_switch: bool) -> None:
  for name in names:
    order = collective_order.schedule(compiled_step(name)[0].as_text())
    nested = [c for c in order if c.nested]
    assert order and not nested, (name, nested)
  if not with_switch:
    return
  # The switch the GPU/TPU transports keep: a nested all_to_all with an
  # independent collective after it, which the checker must find.
  keep = transport.bucket_switch_for
  transport.bucket_switch_for = lambda platform: True
  try:
    switched, args = compiled_step.__wrapped__(names[0])
  finally:
    transport.bucket_switch_for = keep
  found = collective_order.hazards(switched.as_text())
  assert found and all("all-to-all" in h.first.nested for h in found), found
  # The switch's branches (GPU/TPU) give the CPU path's results bit for bit
  # (one call, waited for: 154 such calls in a row did not hang before the fix).
  cpu, _ = compiled_step(names[0])
  got, want = (jax.tree.leaves(jax.block_until_ready(f(*args))) for f in (switched, cpu))
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want)), "switch != no switch"


def stress(names, calls: int) -> None:
  steps = [compiled_step(name) for name in names]
  for _ in range(calls):
    for fn, args in steps:
      jax.block_until_ready(fn(*args))


def main(group: str, *rest: str) -> None:
  flags.FLAGS(["order_child"])  # the bench's ep_* flags at their defaults
  assert jax.device_count() == 8, jax.devices()
  names = {"default": BUCKETED[:1], "all": BUCKETED}.get(group)
  if names is None or len(rest) != 1:
    raise SystemExit(f"error: order_child.py {group} {' '.join(rest)}: use 'default CALLS' "
                     "or 'all CALLS'")
  check_structure(names, with_switch=group == "all")
  stress(names, int(rest[0]))
  print(f"OK {group}")


if __name__ == "__main__":
  main(*sys.argv[1:])
