"""Child process of test_global_stats.py: needs 4 simulated CPU devices.

Run as ``JAX_NUM_CPU_DEVICES=4 python tests/balance/global_stats_child.py``.
Checks that every statistic computed with ``axis_names`` inside
``jax.shard_map`` equals the single-device value on the full batch, and that
the per-shard (local) loss differs, so the check can fail. Exits non-zero
with a message on the first mismatch.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The package of this checkout, not whichever one the interpreter has installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moejax import config as C  # noqa: E402
from moejax.balance import capacity as cap  # noqa: E402
from moejax.balance import losses as L  # noqa: E402
from moejax.balance import metrics as M  # noqa: E402
from moejax.routing.types import RoutingResult  # noqa: E402

T, E, Z, K, B, S, D = 32, 8, 2, 2, 8, 4, 4  # 8 FFN + 2 zero-computation experts
CFG = C.MoEConfig(
    topology=C.TopologyConfig(num_experts=E, zero_experts=Z), routing=C.RoutingConfig(top_k=K),
    balance=C.BalanceConfig(aux_loss_coef=0.01, aux_loss_scope="global",
                            device_loss_coef=0.05, comm_loss_coef=0.02,
                            loss_num_devices=D, z_loss_coef=1e-3))


def routing(logits):
  """Softmax top-K routing of logits f32[T, E+Z] (built here, not by a router)."""
  probs = jax.nn.softmax(logits, axis=-1)
  gates, ids = jax.lax.top_k(probs, K)
  return RoutingResult(expert_ids=ids.astype(jnp.int32), weights=gates,
                       valid=jnp.ones((logits.shape[0], K), bool), probs=probs, logits=logits)


def make_logits():
  # Each quarter of the batch (one shard) prefers a different expert, so local
  # statistics differ from global ones.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(T, E + Z)).astype(np.float32)
  for shard in range(4):
    logits[shard * T // 4:(shard + 1) * T // 4, 2 * shard] += 3.0
  return jnp.asarray(logits)


def capacity_per_shard(r, shards):
  """apply_capacity on each of ``shards`` contiguous token blocks (capacity is local)."""
  split = jax.tree.map(lambda x: x.reshape((shards, -1) + x.shape[1:]), r)
  new, dropped = jax.vmap(lambda x: cap.apply_capacity(x, 3, num_experts=E))(split)
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), (new, dropped))


def stats(r, axis_names, shards=1):
  """Every global statistic of the balance plane, on one shard or the full batch."""
  new, dropped = capacity_per_shard(r, shards)
  out = {
      "lb_switch": L.load_balance_loss(r, convention="switch", num_experts=E + Z,
                                       axis_names=axis_names),
      "lb_topk": L.load_balance_loss(r, convention="topk", num_experts=E + Z,
                                     axis_names=axis_names),
      "device": L.device_balance_loss(r, num_experts=E, num_devices=D, axis_names=axis_names),
      "comm": L.comm_balance_loss(r, num_experts=E, num_devices=D, max_devices=2,
                                  axis_names=axis_names),
      "sequence": L.sequence_balance_loss(r, batch_shape=(r.num_tokens // S, S),
                                          num_experts=E + Z, axis_names=axis_names),
      "load": M.expert_load(r, E, axis_names),
      "coactivation": M.coactivation(r, E, axis_names),
      "drop_rate": M.drop_rate(dropped, r.valid & (r.expert_ids < E), axis_names),
  }
  _, out["active_mean"], out["active_var"] = M.active_experts(r, E, axis_names)
  for name, value in M.routing_metrics(new, CFG, dropped=dropped,
                                       axis_names=axis_names).present().items():
    out["metrics/" + name] = value
  bl = L.balance_losses(r, CFG, batch_shape=(r.num_tokens // S, S), axis_names=axis_names)
  for name in ("aux_loss", "device_loss", "comm_loss"):
    out["losses/" + name] = bl[name]
  return out


def grad_topk(logits, axis_names):
  return jax.grad(lambda lg: L.load_balance_loss(
      routing(lg), convention="topk", num_experts=E + Z, axis_names=axis_names))(logits)


def check(mesh, token_axes):
  spec = P(token_axes)
  logits = make_logits()
  full = stats(routing(logits), (), shards=4)
  assert float(full["drop_rate"]) > 0, "capacity 3 should drop something here"

  sharded = jax.device_put(logits, NamedSharding(mesh, spec))
  glob = jax.jit(jax.shard_map(lambda lg: stats(routing(lg), token_axes), mesh=mesh,
                               in_specs=spec, out_specs=P()))(sharded)
  for name, want in full.items():
    np.testing.assert_allclose(glob[name], want, rtol=1e-5, atol=1e-6, err_msg=name)

  # The local (per-shard) loss is a different number: the check can fail.
  local = jax.jit(jax.shard_map(
      lambda lg: L.load_balance_loss(routing(lg), convention="topk",
                                     num_experts=E + Z)[None],
      mesh=mesh, in_specs=spec, out_specs=spec))(sharded)
  gap = abs(float(jnp.mean(local)) - float(full["lb_topk"]))
  assert gap > 0.1, f"local and global losses agree ({gap}); the test is vacuous"

  g_full = grad_topk(logits, ())
  g_glob = jax.jit(jax.shard_map(lambda lg: grad_topk(lg, token_axes), mesh=mesh,
                                 in_specs=spec, out_specs=spec))(sharded)
  np.testing.assert_allclose(g_glob, g_full, rtol=1e-5, atol=1e-7, err_msg="gradient")
  return gap


def main():
  assert len(jax.devices()) == 4, f"need 4 devices, got {jax.devices()}"
  gap1 = check(jax.make_mesh((4,), ("data",)), "data")
  gap2 = check(jax.make_mesh((2, 2), ("data", "expert")), ("data", "expert"))
  print(f"OK global == full batch; local-vs-global gap {gap1:.3f} / {gap2:.3f}")


if __name__ == "__main__":
  sys.exit(main())
