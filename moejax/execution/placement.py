"""Runtime expert placement with replication of hot experts (DeepSeek EPLB style).

Legend: E logical experts (what the router chooses), D expert-parallel
devices, S physical expert slots per device, E_p = D * S physical experts,
R_max most replicas of one expert.

Routing decides *logical* experts; a placement decides where their weights
physically live. Given measured per-expert loads, :func:`compute_placement`

1. gives the E_p - E spare slots to the hottest experts, one at a time, to
   the expert with the largest load per replica (EPLB ``replicate_experts``);
2. packs the E_p replicas, heaviest first (each carrying load / replicas),
   onto the device with the least load that still has a free slot,
   preferring devices that do not already hold that expert (EPLB
   ``balanced_packing``).

With ``devices_per_node`` and ``keep_nodes`` it is EPLB's hierarchical
policy: every expert stays on the node that owns it in the contiguous layout
(steps 1-2 run per node), which keeps node-limited routing's bound intact.

The layer (:func:`moejax.execution.parallel.ep_moe_layer` with
``placement=``) sends each token copy of expert e to one of e's replicas,
chosen by token index (t mod replicas), and computes it with the replica's
weights, gathered from the logical weights, so gradients of all replicas sum
into the logical expert. Routing decisions, drops and outputs are unchanged;
only which device does the work moves.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """A static expert -> physical slot map (numpy; hashable by identity).

  Attributes:
    phys_to_logical: int[E_p] logical expert held by physical slot p; slot p
      is on device p // S.
    replicas: int[E, R_max] physical slots of each logical expert, padded
      with -1.
    num_replicas: int[E] replicas per logical expert (>= 1).
    slots_per_device: S.
  """

  phys_to_logical: np.ndarray
  replicas: np.ndarray
  num_replicas: np.ndarray
  slots_per_device: int

  @property
  def num_devices(self) -> int:
    return len(self.phys_to_logical) // self.slots_per_device

  @property
  def num_experts(self) -> int:
    return len(self.num_replicas)

  def device_of_slot(self) -> np.ndarray:
    return np.arange(len(self.phys_to_logical)) // self.slots_per_device

  def device_loads(self, load) -> np.ndarray:
    """f[D] expected load per device when each expert's load splits evenly over replicas."""
    load = np.asarray(load, np.float64)
    per = load[self.phys_to_logical] / self.num_replicas[self.phys_to_logical]
    return per.reshape(self.num_devices, self.slots_per_device).sum(-1)


def _from_slots(phys_to_logical: np.ndarray, num_experts: int, slots: int) -> Placement:
  phys_to_logical = np.asarray(phys_to_logical, np.int64)
  counts = np.bincount(phys_to_logical, minlength=num_experts)
  if (counts == 0).any():
    raise ValueError(f"placement leaves experts {np.flatnonzero(counts == 0).tolist()} "
                     "without a physical slot")
  reps = np.full((num_experts, counts.max()), -1, np.int64)
  fill = np.zeros(num_experts, np.int64)
  for p, e in enumerate(phys_to_logical):
    reps[e, fill[e]] = p
    fill[e] += 1
  return Placement(phys_to_logical, reps, counts, slots)


def identity_placement(num_experts: int, num_devices: int) -> Placement:
  """The contiguous layout: expert e on device e // (E / D), no replicas."""
  if num_experts % num_devices:
    raise ValueError(f"identity_placement: num_devices={num_devices} does not divide "
                     f"num_experts={num_experts}")
  return _from_slots(np.arange(num_experts), num_experts, num_experts // num_devices)


def from_phys_to_logical(phys_to_logical, num_experts: int, num_devices: int) -> Placement:
  """A placement from an explicit int[D * S] slot map (every expert at least once)."""
  phys_to_logical = np.asarray(phys_to_logical)
  if phys_to_logical.ndim != 1 or len(phys_to_logical) % num_devices:
    raise ValueError(f"phys_to_logical has shape {phys_to_logical.shape}; expected "
                     f"[D * S] with D={num_devices}")
  if phys_to_logical.min() < 0 or phys_to_logical.max() >= num_experts:
    raise ValueError(f"phys_to_logical entries must be in [0, {num_experts})")
  return _from_slots(phys_to_logical, num_experts, len(phys_to_logical) // num_devices)


def _replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
  """int[E] replicas: spare slots go, one by one, to the max load-per-replica expert."""
  reps = np.ones(len(load), np.int64)
  for _ in range(num_slots - len(load)):
    reps[np.argmax(load / reps)] += 1
  return reps


def _pack(load: np.ndarray, reps: np.ndarray, num_devices: int,
          slots: int) -> list[list[int]]:
  """Greedy balanced packing of replicas (expert ids) onto devices with ``slots`` each."""
  items = [(load[e] / reps[e], e) for e in range(len(load)) for _ in range(reps[e])]
  items.sort(key=lambda it: (-it[0], it[1]))
  dev_load = np.zeros(num_devices)
  bins: list[list[int]] = [[] for _ in range(num_devices)]
  for w, e in items:
    free = [j for j in range(num_devices) if len(bins[j]) < slots]
    fresh = [j for j in free if e not in bins[j]] or free
    j = min(fresh, key=lambda j: (dev_load[j], j))
    bins[j].append(e)
    dev_load[j] += w
  return bins


def compute_placement(load, num_devices: int, slots_per_device: Optional[int] = None, *,
                      devices_per_node: Optional[int] = None,
                      keep_nodes: bool = False) -> Placement:
  """EPLB-style placement of E experts on D devices with S slots each.

  Args:
    load: f[E] measured token copies per expert (e.g. ``aux['load']`` summed
      over steps).
    num_devices: D, the expert axis size.
    slots_per_device: S >= E / D; S * D - E slots hold replicas of hot
      experts. Default E / D (no replication, only re-packing).
    devices_per_node / keep_nodes: keep every expert (and its replicas) on
      its contiguous-layout node (EPLB hierarchical; needed with node-limited
      routing).

  Returns:
    A :class:`Placement`; slots on one device are sorted by expert id.
  """
  load = np.asarray(load, np.float64)
  e = load.shape[0]
  if load.ndim != 1 or (load < 0).any():
    raise ValueError(f"compute_placement: load must be f[E] >= 0, got shape {load.shape}")
  if e % num_devices:
    raise ValueError(f"compute_placement: num_devices={num_devices} does not divide the "
                     f"{e} experts. Fix: use a divisor of {e}")
  s = e // num_devices if slots_per_device is None else int(slots_per_device)
  if s * num_devices < e:
    raise ValueError(f"compute_placement: slots_per_device={s} x {num_devices} devices "
                     f"< {e} experts. Fix: use slots_per_device >= {e // num_devices}")
  groups = [(np.arange(e), np.arange(num_devices))]
  if keep_nodes:
    if devices_per_node is None:
      raise ValueError("compute_placement: keep_nodes needs devices_per_node")
    p = min(devices_per_node, num_devices)
    if num_devices % p:
      raise ValueError(f"compute_placement: devices_per_node={p} does not divide "
                       f"num_devices={num_devices}")
    n = num_devices // p
    groups = [(np.arange(i * e // n, (i + 1) * e // n), np.arange(i * p, (i + 1) * p))
              for i in range(n)]
  slot_map = np.zeros(num_devices * s, np.int64)
  for experts, devices in groups:
    sub = load[experts]
    reps = _replicate(sub + 1e-12, len(devices) * s)  # epsilon: split ties, not zeros
    bins = _pack(sub, reps, len(devices), s)
    for j, b in zip(devices, bins):
      slot_map[j * s:(j + 1) * s] = experts[np.sort(np.asarray(b, np.int64))]
  return _from_slots(slot_map, e, s)
