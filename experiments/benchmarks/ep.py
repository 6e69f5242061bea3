r"""Expert-parallel benchmark (``--suite=ep``): step time and all-to-all bytes.

Usage (8 simulated CPU devices are set up by the suite itself when JAX has
not started yet; otherwise export JAX_NUM_CPU_DEVICES=8):
  python -m experiments.bench --suite=ep --json_out=/tmp/ep.json

For each shape it times, side by side in one process (round-robin repeats,
medians), forward+backward of
  * ``single``: the single-device layer (``moejax.layer.moe_layer``,
    ``blocked`` backend) on the whole batch, on one device;
  * ``ep_capacity``: the expert-parallel layer on ``--ep_devices`` devices,
    dropless, with the default dispatch: each token once per destination
    device (``dispatch_unit='token'``) through the padded all_to_all with
    its per-step bucket (``capacity_buckets``);
  * ``ep_capacity_copy``: one row per token copy, bucketed;
  * ``ep_capacity_cf``: the default dispatch with ``--ep_capacity_factor``
    (drops counted);
  * ``ep_ragged``: dropless exact-size segments (``ragged_all_to_all``; on
    CPU the emulated fallback, padded to the bucket), one per token;
  * ``ep_node_limited``: each token limited to ``--ep_limit_nodes`` nodes of
    ``--ep_devices_per_node`` devices, dispatched once per node across nodes
    and forwarded inside the node (``dispatch_unit='node'``);
and reports, from the layer's own accounting (``aux['comm']``, both
directions of one forward pass, summed over devices): bytes on the wire,
routed copies, the analytic minimum for the routing made (each token once
per distinct remote device / node), their ratios, padding waste, the
share crossing nodes, cross-node rows over the once-per-node minimum and the
expert ids and gate weights a deduplicating dispatch sends with its rows.

Simulated devices share the host's cores, so EP step time here measures the
layer's overhead (permutes, buffers, collectives), not a speedup.
"""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.benchmarks import common, registry
from experiments.benchmarks import lib as bench_lib

_DEVICES = flags.DEFINE_integer("ep_devices", 8, "expert-axis devices (simulated on CPU)")
_PER_NODE = flags.DEFINE_integer("ep_devices_per_node", 4, "devices per node")
_LIMIT = flags.DEFINE_integer("ep_limit_nodes", 1, "M nodes per token for ep_node_limited")
_EP_CF = flags.DEFINE_float("ep_capacity_factor", 1.25, "capacity factor of ep_capacity_cf")
_EP_SHAPES = flags.DEFINE_list("ep_shapes", ["coarse", "fine"], "shapes to run")
_EP_BATCH = flags.DEFINE_integer("ep_batch", 32, "sequences in the global batch")
_EP_SEQ = flags.DEFINE_integer("ep_seq", 128, "sequence length")
_EP_D = flags.DEFINE_integer("ep_d_model", 256, "model width")

SHAPES = {"coarse": dict(num_experts=16, top_k=2, expert_width=512),
          "fine": dict(num_experts=64, top_k=8, expert_width=128)}
COMM_KEYS = ("wire", "copies", "min_device", "min_node", "wire_cross_node",
             "copies_cross_node", "padding_waste", "wire_max_device", "meta")


def ensure_devices(n: int) -> None:
  """Asks for n simulated CPU devices; a clear error if JAX already started with fewer."""
  try:
    if jax.config.jax_num_cpu_devices < n:
      jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # JAX already started: keep what it has
    pass
  have = len(jax.devices())
  if have < n:
    raise app.UsageError(f"--suite=ep needs {n} devices, JAX has {have}. Fix: export "
                         f"JAX_NUM_CPU_DEVICES={n} (before JAX starts) or pass --ep_devices")


def _time(fns: dict, repeats: int, shape: str) -> tuple[dict, dict]:
  """({variant: median seconds}, {variant: error of its first run}), round-robin repeats."""
  errors = {}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    try:
      jax.block_until_ready(fn())
    except Exception as e:  # noqa: BLE001 - its row says so, the others still run
      errors[name] = bench_lib.variant_failed(f"{shape}/{name}", e)
      continue
    logging.info("compiled+ran %s in %.2fs", name, time.perf_counter() - t0)
  live = {n: f for n, f in fns.items() if n not in errors}
  times = {n: [] for n in live}
  for _ in range(repeats):
    for name, fn in live.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  return {n: float(np.median(ts)) for n, ts in times.items()}, errors


def _variants(shape: str):
  from moejax import config as C
  from moejax.execution import mesh as mesh_lib
  d = _DEVICES.value
  base = dict(expert=d, data=1, devices_per_node=_PER_NODE.value)
  shape_ = dict(SHAPES[shape])
  moe = dict(topology=dict(num_experts=shape_["num_experts"],
                           expert_width=shape_["expert_width"]),
             execution=dict(backend="blocked"), routing=dict(top_k=shape_["top_k"]))
  cfg = C.from_dict(C.MoEConfig, moe)
  cf = C.from_dict(C.MoEConfig, dict(moe, balance=dict(capacity_factor=_EP_CF.value)))
  limit = dict(route_limit="nodes", route_limit_count=_LIMIT.value)
  limited = C.ParallelConfig(**base, **limit, dispatch_unit="node")
  return cfg, {
      "ep_capacity_copy": (cfg, C.ParallelConfig(**base, dispatch_unit="copy")),
      "ep_capacity": (cfg, C.ParallelConfig(**base)),
      "ep_capacity_cf": (cf, C.ParallelConfig(**base)),
      "ep_ragged": (cfg, C.ParallelConfig(**base, dispatch="ragged")),
      "ep_node_limited": (C.resolve_route_limit(cfg, limited), limited),
  }


def _ep_variant(shape: str, name: str, step, params, x, vcfg, pcfg) -> tuple:
  """(the variant's timed call, its comm accounting) after its compiling first run."""
  from moejax import layer as L
  from moejax.execution import mesh as mesh_lib
  mesh = mesh_lib.make_mesh(pcfg, jax.devices()[:pcfg.expert], cfg=vcfg)
  f = step(lambda p, x: L.ep_moe_layer(p, x, None, vcfg, mesh, pcfg))
  pp, xx = mesh_lib.shard_params(params, mesh), mesh_lib.shard_batch(x, mesh)
  t0 = time.perf_counter()
  (_, aux), _ = f(pp, xx)
  bench_lib.progress(f"compiled+ran {shape}/{name} in {time.perf_counter() - t0:.2f}s")
  meta = {key: float(aux.execution["comm"][key]) for key in COMM_KEYS}
  meta["num_dropped"] = int(aux.num_dropped)
  return (lambda: f(pp, xx)), meta


def _row(sec: float, single: float, m: dict | None) -> dict:
  row = {"step_s": sec, "x_single": sec / single}
  if m is not None:
    row.update(m)
    row["wire_over_min"] = m["wire"] / m["min_device"] if m["min_device"] else 0.0
    row["copies_over_min"] = m["copies"] / m["min_device"] if m["min_device"] else 0.0
    row["cross_node_share"] = m["wire_cross_node"] / m["wire"] if m["wire"] else 0.0
    row["cross_copies_over_min_node"] = (m["copies_cross_node"] / m["min_node"]
                                         if m["min_node"] else 0.0)
  return row


def run_shape(shape: str, repeats: int) -> dict:
  """One shape's rows; a variant that raises is a row ``{"error": ...}`` (bench_lib.failures
  finds it, the binary exits 1 naming it) and the other variants still run."""
  from moejax import layer as L
  cfg, variants = _variants(shape)
  b, s, dm = _EP_BATCH.value, _EP_SEQ.value, _EP_D.value
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  params = L.init_moe_params(k[0], dm, cfg)
  x = jax.random.normal(k[1], (b, s, dm), jnp.float32)
  cot = jax.random.normal(k[2], (b, s, dm), jnp.float32)

  def step(layer):
    def loss(p, x):
      y, aux = layer(p, x)
      return jnp.vdot(y, cot) + aux.losses["total"], aux
    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

  dev0 = jax.devices()[0]
  single = step(lambda p, x: L.moe_layer(p, x, None, cfg))
  p0, x0 = jax.device_put((params, x), dev0)
  fns = {"single": lambda: single(p0, x0)}
  meta, errors = {}, {}
  for name, (vcfg, pcfg) in variants.items():
    try:
      fns[name], meta[name] = _ep_variant(shape, name, step, params, x, vcfg, pcfg)
    except Exception as e:  # noqa: BLE001 - its row says so, the others still run
      errors[name] = bench_lib.variant_failed(f"{shape}/{name}", e)
  timed, failed = _time(fns, repeats, shape)
  errors.update(failed)
  # Without the single-device time the ratios are unknown, not an error of their own.
  base = timed.get("single", float("nan"))
  rows = {name: ({"error": errors[name]} if name in errors
                 else _row(timed[name], base, meta.get(name)))
          for name in ["single", *variants]}
  return {"B": b, "S": s, "d": dm, **SHAPES[shape], "devices": _DEVICES.value,
          "devices_per_node": _PER_NODE.value, "limit_nodes": _LIMIT.value,
          "capacity_factor": _EP_CF.value, "variants": rows}


def conditions() -> dict:
  return {"platform": jax.default_backend(), "num_devices": len(jax.devices()),
          "cpu_count": os.cpu_count(), "load_avg_1_5_15": list(os.getloadavg()),
          "jax": jax.__version__, "python": platform.python_version()}


def ep_suite(repeats: int) -> dict:
  ensure_devices(_DEVICES.value)
  unknown = set(_EP_SHAPES.value) - set(SHAPES)
  if unknown:
    raise app.UsageError(f"--ep_shapes: unknown {sorted(unknown)}; use {sorted(SHAPES)}")
  out = {"conditions": conditions(), "shapes": {}}
  for shape in _EP_SHAPES.value:
    out["shapes"][shape] = run_shape(shape, repeats)
  out["conditions_after"] = {"load_avg_1_5_15": list(os.getloadavg())}
  return out


def table_text(res: dict) -> str:
  """The per-shape tables as the suite prints them (docs/benchmarks.md's ep_bench block)."""
  mb = 2.0 ** 20
  lines = []
  for shape, s in res["shapes"].items():
    lines += ["", f"{shape}: B={s['B']} S={s['S']} d={s['d']} E={s['num_experts']} "
              f"K={s['top_k']} f={s['expert_width']}, {s['devices']} devices, "
              f"{s['devices_per_node']} per node; bytes = both directions, one forward",
              f"{'variant':<20}{'step s':>7}{'x single':>9}{'wire MiB':>9}{'min MiB':>8}"
              f"{'wire/min':>9}{'copy/min':>9}{'pad':>6}{'x-node':>7}{'minN MiB':>9}"
              f"{'xcp/minN':>9}{'meta MiB':>9}{'drops':>6}"]
    for name, r in s["variants"].items():
      if "step_s" not in r:
        lines.append(f"{name:<20}failed: {r.get('error', 'no result')}")
      elif name == "single":
        lines.append(f"{name:<20}{r['step_s']:>7.3f}{r['x_single']:>9.2f}")
      else:
        lines.append(
            f"{name:<20}{r['step_s']:>7.3f}{r['x_single']:>9.2f}{r['wire'] / mb:>9.2f}"
            f"{r['min_device'] / mb:>8.2f}{r['wire_over_min']:>9.2f}"
            f"{r['copies_over_min']:>9.2f}{r['padding_waste']:>6.2f}"
            f"{r['cross_node_share']:>7.2f}{r['min_node'] / mb:>9.2f}"
            f"{r['cross_copies_over_min_node']:>9.2f}{r['meta'] / mb:>9.2f}"
            f"{r['num_dropped']:>6}")
  return "\n".join(lines)


def print_ep_table(res: dict) -> None:
  print(table_text(res))


SUITE = registry.register(registry.Suite(
    "ep", "the expert-parallel layer's step time and all-to-all bytes on simulated devices",
    lambda: ep_suite(common.repeats()), print_ep_table))
