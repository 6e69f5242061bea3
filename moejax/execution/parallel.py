"""The expert-parallel MoE layer: ``jax.shard_map`` over a ('data', 'fsdp', 'expert') mesh.

Legend: B batch, S sequence length, T tokens on one device, d model width,
K slots per token, E logical FFN experts, D devices on the ``expert`` axis,
S_p physical expert slots per device (E / D without a placement), E_p = D *
S_p physical experts, C capacity per (device, expert), f expert hidden width,
L = T * min(K, S_p) most rows one device can send to another.

Per device (see :mod:`moejax.execution.mesh` for the layout), inside
``shard_map``::

    route (local tokens) -> capacity drops (per device, see below)
    -> local permute -> all_to_all over 'expert' -> grouped matmul on the
    S_p local experts -> all_to_all back -> combine (unpermute, gate, sum)
    + zero-computation and shared experts (local, no communication)

Dispatch paths (``ParallelConfig.dispatch``):

* ``capacity``: every device fills an [E_p, C] buffer (``permute.
  capacity_layout``) and the all_to_all moves fixed [S_p, C, d] slices;
  runs on every backend, CPU included. With ``moe.capacity_factor`` set, C
  is the layer's capacity; dropless layers use C = T (a token sends at most
  one copy to an expert), exact but padded: the padding shows in
  ``aux['comm']['padding_waste']``.
* ``ragged``: dropless and unpadded: rows sorted by expert
  (``permute.sort_by_expert``) travel in exact-size segments with
  ``jax.lax.ragged_all_to_all`` (``native``, GPU/TPU). XLA:CPU does not
  implement that collective; there ``emulated`` moves the same segments
  through a padded all_to_all of [D, L, d] and scatters them at the offsets
  the native collective would use, so the whole ragged bookkeeping is
  tested on CPU and the results are identical. ``native`` on a platform
  without the collective is refused before compiling.

**Capacity semantics** (GShard's groups): the global batch is split into
one group per device (its B / N sequences); inside a group the layer applies
``moejax.balance.capacity`` exactly as the single-device layer does, with
C = ceil(cf * T * K / E) for the group's T tokens and the configured
priority (``position``: slot-major, earlier tokens first). The
expert-parallel layer therefore drops exactly what
``moejax.layer.moe_layer`` drops when called on each device's shard with
the same config; ``aux['num_dropped']`` is the global count. Routers whose
decision depends on other tokens (expert choice) are likewise applied per
group. Token-choice routing without capacity is per token, so it equals the
single-device layer on the whole batch.

**Global statistics**: loads (``aux['load']``, the bias controller input),
``metrics`` (MaxVio, drop rate, ...) and global-scope balance losses are
psum-reduced over every mesh axis, so they equal the single-device values on
the whole batch. Batch- and sequence-scope losses are local by definition;
the layer returns their mean over devices (what data-parallel averaging of
per-shard losses gives). Router noise uses ``fold_in(rng, device index)``:
with noise on, the layer is equal in distribution, not bitwise.

A :class:`~moejax.execution.placement.Placement` moves and replicates
experts over devices without changing any routing decision (see that
module); the per-device work shows in ``aux['device_load']``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax import layer as layer_lib
from moejax.balance import losses, metrics, stats
from moejax.config import MoEConfig
from moejax.execution import comm as comm_lib
from moejax.execution import grouped_ffn
from moejax.execution import mesh as mesh_lib
from moejax.execution import permute as permute_lib
from moejax.execution import placement as placement_lib
from moejax.execution.mesh import EXPERT, FSDP, ParallelConfig
from moejax.routing.types import RouterState, RoutingResult
from moejax.topology import experts as experts_lib

NATIVE_RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


class RaggedUnsupportedError(ValueError):
  """``ragged_all_to_all`` was asked for natively on a platform without it."""


def resolve_dispatch(pcfg: ParallelConfig, platform: str) -> str:
  """'capacity', 'ragged_native' or 'ragged_emulated' for ``platform``."""
  if pcfg.dispatch == "capacity":
    return "capacity"
  native = platform in NATIVE_RAGGED_PLATFORMS
  if pcfg.ragged_impl == "native" and not native:
    raise RaggedUnsupportedError(
        f"parallel.ragged_impl='native': jax.lax.ragged_all_to_all is not implemented on "
        f"{platform!r} (XLA:CPU has no ragged-all-to-all). Fix: ragged_impl='emulated' "
        "(same segments over a padded all_to_all, identical results) or 'auto', or "
        "dispatch='capacity'")
  if pcfg.ragged_impl == "emulated" or not native:
    return "ragged_emulated"
  return "ragged_native"


def gmm_backend_for(cfg: MoEConfig, pcfg: ParallelConfig) -> str:
  if pcfg.gmm_backend is not None:
    return pcfg.gmm_backend
  return "ragged_dot" if cfg.backend == "reference" else cfg.backend


# --- Local pieces (run per device inside shard_map). ------------------------

def _a2a(x: jax.Array) -> jax.Array:
  """all_to_all over 'expert' of [D * n, ...]: chunk j goes to device j."""
  return jax.lax.all_to_all(x, EXPERT, 0, 0, tiled=True)


def local_experts(params: dict, rows: jax.Array, slot: jax.Array, filled: jax.Array,
                  num_slots: int, *, activation: str, backend: str,
                  width_mask: Optional[jax.Array] = None) -> jax.Array:
  """ys[R, d] = FFN_{slot[r]}(rows[r]) where filled, else 0 (grouped matmul).

  rows[R, d] arrive in any order (by source device); a dropless sort by
  local expert gives the grouped-matmul layout, so empty buffer rows cost
  nothing in backends that skip rows past the groups (``blocked``).
  """
  return grouped_ffn.routed_ffn(params, rows, slot[:, None].astype(jnp.int32),
                                filled[:, None], filled.astype(jnp.float32)[:, None],
                                num_experts=num_slots, activation=activation,
                                backend=backend, width_mask=width_mask)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                               output_offsets, recv_sizes, *, max_rows: int):
  """``jax.lax.ragged_all_to_all`` over 'expert' built from a padded all_to_all.

  Same arguments and result as the native collective (``output`` with the
  received segments written at the senders' ``output_offsets``), for
  segments of at most ``max_rows`` rows. Differentiable (gather / scatter).
  """
  p = jnp.arange(max_rows, dtype=jnp.int32)
  take = jnp.where(p[None, :] < send_sizes[:, None], input_offsets[:, None] + p[None, :],
                   operand.shape[0])
  buf = jnp.take(operand, take.reshape(-1), axis=0, mode="fill", fill_value=0)
  got = _a2a(buf)                                                # [D * max_rows, ...]
  at = _a2a(output_offsets)                                      # where source i writes here
  pos = jnp.where(p[None, :] < recv_sizes[:, None], at[:, None] + p[None, :],
                  output.shape[0])
  return output.at[pos.reshape(-1)].set(got.astype(output.dtype), mode="drop")


def _ragged(impl: str, max_rows: int):
  if impl == "ragged_native":
    return lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=EXPERT)
  return functools.partial(emulated_ragged_all_to_all, max_rows=max_rows)


def _physical_ids(result: RoutingResult, sent: jax.Array, plc: placement_lib.Placement):
  """int32[T, K] physical expert of every slot (replica chosen by token index)."""
  logical = jnp.where(sent, result.expert_ids, 0)
  if int(plc.num_replicas.max()) == 1:
    return jnp.asarray(plc.replicas[:, 0], jnp.int32)[logical]
  reps = jnp.asarray(plc.replicas, jnp.int32)
  n = jnp.asarray(plc.num_replicas, jnp.int32)[logical]
  tok = jnp.arange(result.num_tokens, dtype=jnp.int32)[:, None]
  return reps[logical, tok % n]


def _dispatch_combine(experts, width_mask, x, result, *, cfg, impl, plc, cap,
                      backend, node_of):
  """Routed-expert output y[T, d] plus (comm bytes, per-physical-expert rows, transport drops)."""
  t, dm = x.shape
  k = result.k
  e, s = cfg.num_experts, plc.slots_per_device
  d = plc.num_devices
  sent = result.valid & (result.expert_ids >= 0) & (result.expert_ids < e)
  phys = _physical_ids(result, sent, plc)
  weights = jnp.where(result.valid, result.weights, 0)
  ffn = functools.partial(local_experts, num_slots=s, activation=cfg.activation,
                          backend=backend, width_mask=width_mask)
  if impl == "capacity":
    c = t if cap is None else cap
    plan = permute_lib.capacity_layout(phys, sent, d * s, c)
    xs = permute_lib.permute(x, plan)                        # [E_p * C, d]
    recv = _a2a(xs)                                          # [D(src) * S_p * C, d]
    counts = _a2a(plan.group_sizes.reshape(d, s))            # [D(src), S_p]
    p = jnp.arange(c, dtype=jnp.int32)
    filled = p[None, None, :] < counts[:, :, None]           # [D, S_p, C]
    slot = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :, None], filled.shape)
    ys = ffn(experts, recv, slot.reshape(-1), filled.reshape(-1))
    back = _a2a(ys)                                          # [E_p * C, d]
    wire_rows = jnp.full((d,), s * c, jnp.int32)
  else:
    max_rows = t * min(k, s)
    move = _ragged(impl, max_rows)
    plan = permute_lib.sort_by_expert(phys, sent, d * s)
    xs = permute_lib.permute(x, plan)                        # [T K, d] by physical expert
    gs = plan.group_sizes.reshape(d, s)
    send_sizes = jnp.sum(gs, axis=1).astype(jnp.int32)
    in_off = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    counts = _a2a(gs)                                        # [D(src), S_p]
    recv_sizes = jnp.sum(counts, axis=1).astype(jnp.int32)
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    out_off = _a2a(recv_off)                                 # my segment's place on device j
    n_out = d * max_rows
    recv = move(xs, jnp.zeros((n_out, dm), x.dtype), in_off, send_sizes, out_off,
                recv_sizes)
    # Received rows: by source, then by local slot. Row r's slot comes from
    # the (source, slot) segment ends, which never decrease in r.
    ends = (recv_off[:, None] + jnp.cumsum(counts, axis=1)).reshape(-1)
    seg = jnp.searchsorted(ends, jnp.arange(n_out, dtype=jnp.int32), side="right")
    filled = seg < d * s
    ys = ffn(experts, recv, jnp.where(filled, seg % s, 0), filled)
    back_off = _a2a(in_off)                                  # my rows' place on each source
    back = move(ys, jnp.zeros((t * k, dm), x.dtype), recv_off, recv_sizes, back_off,
                send_sizes)
    wire_rows = send_sizes if impl == "ragged_native" else jnp.full((d,), max_rows,
                                                                     jnp.int32)
  y = permute_lib.unpermute(back, plan, weights).astype(x.dtype)
  dispatched = plan.dispatched()
  me = jax.lax.axis_index(EXPERT)
  bytes_local = comm_lib.local_dispatch_bytes(phys // s, dispatched, wire_rows, me,
                                              node_of, dm * x.dtype.itemsize)
  lost = jnp.sum(sent & ~dispatched, dtype=jnp.int32)
  return y, bytes_local, plan.group_sizes, lost


def _gather_fsdp(experts: dict, has_fsdp: bool) -> dict:
  """Full-width local expert weights: the d axis was sharded over 'fsdp'."""
  if not has_fsdp:
    return experts
  # all_gather's transpose is a reduce-scatter: gradients come back sharded.
  return {k: jax.lax.all_gather(v, FSDP, axis=2 if k == "w_down" else 1, tiled=True)
          for k, v in experts.items()}


def _device_index(axes) -> jax.Array:
  idx = jnp.zeros((), jnp.int32)
  for a in axes:
    idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return idx


def _body(args, *, cfg: MoEConfig, impl: str, plc, backend: str, node_of, axes,
          has_fsdp: bool, train: bool):
  params, x, state = args["params"], args["x"], args["state"]
  b, s, dm = x.shape
  x2 = x.reshape(b * s, dm)
  ids = args["token_ids"].reshape(-1) if "token_ids" in args else None
  rng = args.get("rng")
  if rng is not None:
    rng = jax.random.fold_in(rng, _device_index(axes))
  result, dropped, cap = layer_lib.route_and_drop(params, x2, state, cfg, token_ids=ids,
                                                  rng=rng, train=train)
  experts = _gather_fsdp(params["experts"], has_fsdp)
  y, bytes_local, phys_rows, lost = _dispatch_combine(
      experts, args.get("width_mask"), x2, result, cfg=cfg, impl=impl, plc=plc, cap=cap,
      backend=backend, node_of=node_of)
  y = layer_lib.add_token_local_experts(params, x2, result, cfg, y)
  new_state, load_all = layer_lib.controller_step(state, result, cfg, train=train,
                                                  axis_names=axes)
  layer_losses = losses.balance_losses(result, cfg, batch_shape=(b, s), axis_names=axes)
  d, sp = plc.num_devices, plc.slots_per_device
  comm = comm_lib.summarize(bytes_local, axes)
  comm["transport_dropped"] = stats.psum(lost, axes)
  aux = {
      "losses": {k: stats.pmean(v, axes) for k, v in layer_losses.items()},
      "metrics": metrics.routing_metrics(result, cfg, dropped=dropped, axis_names=axes),
      "load": load_all[: cfg.num_experts],
      "num_dropped": stats.psum(jnp.sum(dropped), axes),
      "device_load": stats.psum(phys_rows.astype(jnp.float32), axes).reshape(d, sp).sum(-1),
      "comm": comm,
      "routing": result,
  }
  return y.reshape(b, s, dm), new_state, aux


# --- The public layer. ------------------------------------------------------

def check_placement(plc: placement_lib.Placement, cfg: MoEConfig, pcfg: ParallelConfig,
                    node_of: np.ndarray) -> None:
  """ValueError when the placement does not fit the mesh or breaks a routing limit."""
  if plc.num_experts != cfg.num_experts or plc.num_devices != pcfg.expert:
    raise ValueError(f"placement covers {plc.num_experts} experts on {plc.num_devices} "
                     f"devices; the layer has moe.num_experts={cfg.num_experts} on "
                     f"parallel.expert={pcfg.expert}. Fix: compute_placement(load, "
                     f"{pcfg.expert}, ...) with this config's load")
  if pcfg.route_limit == "none":
    return
  home = np.arange(cfg.num_experts) // (cfg.num_experts // pcfg.expert)
  where = plc.device_of_slot()
  home_of_slot = home[plc.phys_to_logical]
  if pcfg.route_limit == "devices":
    bad = where != home_of_slot
  else:
    bad = node_of[where] != node_of[home_of_slot]
  if bad.any():
    raise ValueError(f"the placement moves experts {sorted(set(plc.phys_to_logical[bad]))} "
                     f"off their {pcfg.route_limit[:-1]}, which breaks parallel.route_limit="
                     f"{pcfg.route_limit!r} (tokens are limited by the contiguous layout). "
                     "Fix: compute_placement(..., devices_per_node=P, keep_nodes=True) "
                     "with route_limit='nodes', or route_limit='none'")


def ep_moe_layer(params: dict, x: jax.Array, state: Optional[RouterState], cfg: MoEConfig,
                 mesh: Mesh, pcfg: ParallelConfig = ParallelConfig(), *,
                 token_ids: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
                 train: bool = False,
                 placement: Optional[placement_lib.Placement] = None
                 ) -> tuple[jax.Array, RouterState, dict[str, Any]]:
  """Applies one MoE layer with expert parallelism; call it inside ``jax.jit``.

  Args:
    params: from :func:`moejax.layer.init_moe_params` (logical experts [E, ...];
      place with :func:`moejax.execution.mesh.shard_params` to avoid reshards).
    x: [B, S, d] with B divisible by the mesh's device count.
    state: router state (None: zeros).
    cfg: the layer config (``kind='sparse'``).
    mesh: from :func:`moejax.execution.mesh.make_mesh`.
    pcfg: dispatch path, routing limits, nodes; its axis sizes must match the
      mesh's expert axis.
    token_ids: int[B, S], for hash routing.
    rng / train: as :func:`moejax.layer.moe_layer`.
    placement: optional expert placement (replicas of hot experts).

  Returns:
    ``(y [B, S, d], new_state, aux)`` with the single-device layer's aux keys
    (``losses``, ``metrics``, ``load``, ``num_dropped``, ``routing``; the
    routing is [B*S, K] in global token order) plus ``device_load`` f32[D]
    (token copies each expert-axis position computed, summed over data
    groups) and ``comm`` (:mod:`moejax.execution.comm` byte counts and
    ``transport_dropped``, always 0 by construction).
  """
  axes = mesh_lib.mesh_axes(mesh)
  d = mesh_lib.axis_size(mesh, EXPERT)
  if d != pcfg.expert:
    raise ValueError(f"parallel.expert={pcfg.expert} but the mesh's 'expert' axis has "
                     f"{d} devices. Fix: build the mesh with make_mesh(pcfg)")
  mesh_lib.check_experts(pcfg, cfg)
  node_of = mesh_lib.nodes_of_expert_axis(mesh, pcfg.devices_per_node)
  route_cfg = mesh_lib.limited_moe_config(cfg, pcfg, num_nodes=int(node_of.max()) + 1)
  if state is None:
    state = RouterState.zeros(cfg.num_routed)
  if x.ndim != 3:
    raise ValueError(f"ep_moe_layer: x has shape {x.shape}; expected [B, S, d] (the batch "
                     "is split over devices by whole sequences)")
  n = int(np.prod([mesh.shape[a] for a in axes]))
  if x.shape[0] % n:
    raise ValueError(f"ep_moe_layer: batch B={x.shape[0]} is not divisible by the {n} "
                     f"devices of mesh {dict(mesh.shape)}. Fix: use a multiple of {n}")
  if token_ids is not None and tuple(token_ids.shape) != tuple(x.shape[:2]):
    raise ValueError(f"token_ids has shape {token_ids.shape}; expected {x.shape[:2]}")
  plc = placement or placement_lib.identity_placement(cfg.num_experts, d)
  check_placement(plc, cfg, pcfg, node_of)
  impl = resolve_dispatch(pcfg, mesh.devices.flat[0].platform)
  backend = gmm_backend_for(cfg, pcfg)
  has_fsdp = mesh_lib.axis_size(mesh, FSDP) > 1
  if has_fsdp and x.shape[-1] % mesh_lib.axis_size(mesh, FSDP):
    raise ValueError(f"d_model={x.shape[-1]} is not divisible by the fsdp axis "
                     f"({mesh_lib.axis_size(mesh, FSDP)}). Fix: parallel.fsdp must divide d")

  params = dict(params)
  identity = plc.slots_per_device * d == cfg.num_experts and \
      np.array_equal(plc.phys_to_logical, np.arange(cfg.num_experts))
  p2l = jnp.asarray(plc.phys_to_logical, jnp.int32)
  if not identity:
    # Replica weights are gathered from the logical ones, so the gradient of
    # every replica sums into its logical expert.
    params["experts"] = jax.tree.map(lambda w: jnp.take(w, p2l, axis=0), params["experts"])
  specs = mesh_lib.param_specs(params, mesh)
  tok = mesh_lib.batch_spec(mesh)
  args = {"params": params, "x": x, "state": state}
  in_specs = {"params": specs, "x": tok, "state": P()}
  if token_ids is not None:
    args["token_ids"], in_specs["token_ids"] = token_ids, tok
  if rng is not None:
    args["rng"], in_specs["rng"] = rng, P()
  if cfg.expert_widths is not None:
    mask = experts_lib.width_mask(cfg)
    args["width_mask"] = mask if identity else jnp.take(mask, p2l, axis=0)
    in_specs["width_mask"] = P(EXPERT)
  out_specs = (tok, P(), {"losses": P(), "metrics": P(), "load": P(), "num_dropped": P(),
                          "device_load": P(), "comm": P(), "routing": tok})
  body = functools.partial(_body, cfg=route_cfg, impl=impl, plc=plc, backend=backend,
                           node_of=node_of, axes=axes, has_fsdp=has_fsdp, train=train)
  return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                       check_vma=False)(args)
