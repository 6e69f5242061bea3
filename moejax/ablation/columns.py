"""The metric and column lists of an ablation summary, shared by its writer and renderers.

:mod:`moejax.ablation.summary` computes the summary dict over :data:`METRICS`;
:mod:`moejax.ablation.tables`, :mod:`moejax.ablation.plots` and
:mod:`moejax.results.trend` render it. They all need the same lists (which
metrics exist, their titles, units and directions, which get verdicts, which
columns a table shows), so the lists live here, below all of them: the
renderers need not import the summary module, which imports them to write
``summary.md`` and the plots.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from moejax.config.registry import BALANCE_LOSS_LOG_PREFIX

# key in result.json -> (title, unit, direction: -1 lower is better, +1 higher, 0 neither)
METRICS = {
    "val_loss": ("val loss", "nats/token", -1),
    "train_loss": ("train loss", "nats/token", -1),
    "max_vio_batch": ("MaxVio batch", "max/mean load - 1", -1),
    "max_vio_global": ("MaxVio global", "max/mean load - 1", -1),
    "drop_rate": ("drop rate", "share of token copies", -1),
    "specialisation_mi_norm": ("spec. MI/H", "I(expert; domain) / H(domain)", 0),
    "active_experts_mean": ("active experts mean", "FFN experts per token", 0),
    "active_experts_var": ("active experts var", "(experts per token)^2", 0),
    # The budget of what ran (moejax.ablation.realised): over every training step / on the
    # final validation pass; shown in its own table beside the declared slots.
    "active_experts_train": ("realised experts, train", "FFN experts per token, all steps", 0),
    "active_experts_val": ("realised experts, val", "FFN experts per token, validation", 0),
    "soft_dispatch_entropy": ("Soft MoE dispatch entropy", "entropy / log S", 0),
    "soft_combine_entropy": ("Soft MoE combine entropy", "entropy / log slots", 0),
    "peer_experts_touched": ("PEER experts touched", "share of experts per batch", 0),
    "peer_key_max_vio": ("PEER sub-key MaxVio", "max/mean use - 1", -1),
    "mod_capacity_use": ("MoD capacity use", "share of tokens processed", 0),
    "mod_causal_agreement": ("MoD causal agreement", "share of tokens", 0),
    "a2a_bytes_per_token": ("a2a B/token", "bytes per token", 0),
    "moe_latency_p50_ms": ("MoE P50 ms", "ms", 0),
    "moe_latency_p99_ms": ("MoE P99 ms", "ms", 0),
    "probe_teacher_forced_loss": ("probe TF loss", "nats/token", 0),
    "probe_prefix_loss": ("probe prefix loss", "nats/token", 0),
    "probe_leak_gap": ("leak gap", "(prefix - TF) / prefix", 0),
}
VERDICT_METRICS = ("val_loss", "max_vio_global", "max_vio_batch", "drop_rate",
                   "specialisation_mi_norm", "probe_leak_gap")
# Speed-up to a reference arm (moejax.ablation.speedup) and fine-tuning against the suite's
# source (moejax.ablation.sources); absent from other suites' results, so not shown there.
METRICS.update({
    "steps_to_reference": ("steps to ref. loss", "steps", -1),
    "speedup_steps": ("speed-up, steps", "reference steps / steps", 1),
    "speedup_time": ("speed-up, time", "reference seconds / seconds", 1),
    "tokens_per_s": ("tokens/s", "training tokens per second", 0),
    "forgetting": ("forgetting", "Δ loss on pre-training domains, nats/token", -1),
    "target_gain": ("target gain", "-Δ loss on target domains, nats/token", 1),
    "spec_change": ("Δ spec. MI/H", "change of I(expert; domain) / H(domain)", 0),
})
VERDICT_METRICS = VERDICT_METRICS + ("speedup_steps", "speedup_time", "forgetting",
                                     "target_gain", "spec_change")
# Routing consistency (suite.analysis.routing_consistency, moejax.serve.consistency_report):
# per perturbation the share of selected (token, expert) pairs another forward moved, and the
# share of tokens with a moved pair; the shipped perturbations (tests check the registry).
CONSISTENCY_PERTURBATIONS = ("bf16", "decode", "ep1", "ep2", "ep8", "hf", "int4", "int8",
                             "microbatch4", "remat")
for _name in CONSISTENCY_PERTURBATIONS:
  METRICS[f"flip_rate_{_name}"] = (f"flip rate {_name}", "share of selected pairs", -1)
  METRICS[f"token_flip_share_{_name}"] = (f"tokens flipped {_name}", "share of tokens", -1)
METRICS["margin_median"] = ("near-tie margin median", "K-th - (K+1)-th selection key", 0)
METRICS["margin_share_below_1e-3"] = ("margins < 1e-3", "share of tokens x layers", 0)
VERDICT_METRICS = VERDICT_METRICS + tuple(f"flip_rate_{n}" for n in CONSISTENCY_PERTURBATIONS)
# Fine-tuning on replayed routing (suite.analysis.replay_finetune, moejax.ablation.replay_finetune):
# replayed minus own routing, from the arm's final weights on the same batches.
METRICS.update({
    "replay_flip_rate": ("replay flip rate", "share of selected pairs the recording moved", -1),
    "replay_loss_gap": ("replay train gap", "train CE, replayed - own routing, nats/token", 0),
    "replay_val_gap": ("replay val gap", "val loss after fine-tuning, replayed - own", 0),
})
VERDICT_METRICS = VERDICT_METRICS + ("replay_flip_rate", "replay_loss_gap", "replay_val_gap")
BUDGET_KEYS = (("total", "total params"), ("active", "active/token"),
               ("flops_per_token", "FLOPs/token"), ("tokens", "train tokens"))
NOTE_KEYS = (("a2a_bytes_per_token", "a2a_note"), ("exposed_comm", "exposed_comm_note"),
             ("speedup_steps", "speedup_note"))

# Columns of the arms table, in order (a column no arm has is left out).
ARM_COLUMNS = ("val_loss", "max_vio_batch", "max_vio_global", "drop_rate",
               "specialisation_mi_norm", "active_experts_mean", "active_experts_var",
               "soft_dispatch_entropy", "soft_combine_entropy", "peer_experts_touched",
               "peer_key_max_vio", "mod_capacity_use", "mod_causal_agreement",
               "a2a_bytes_per_token", "moe_latency_p99_ms", "probe_teacher_forced_loss",
               "probe_prefix_loss", "probe_leak_gap",
               # fine-tuning against the suite's source (moejax.ablation.sources)
               "target_gain", "forgetting", "spec_change",
               *(f"flip_rate_{n}" for n in CONSISTENCY_PERTURBATIONS), "margin_median",
               "replay_flip_rate", "replay_loss_gap", "replay_val_gap")
# The speed-up table (moejax.ablation.speedup), for suites with a speed-up reference.
SPEEDUP_COLUMNS = ("val_loss", "steps_to_reference", "speedup_steps", "speedup_time",
                   "tokens_per_s")


# Balance losses: one key per loss a run's config puts in the objective (balance/<name>,
# moejax.train.step.balance_loss_summary), so not a fixed list; summarised without verdicts.
def balance_loss_keys(keys: Iterable[str]) -> list[str]:
  """The balance-loss keys among ``keys`` (result.json or summary metric keys), sorted."""
  return sorted({k for k in keys if k.startswith(BALANCE_LOSS_LOG_PREFIX)})


def metric_info(key: str) -> tuple[str, str, int]:
  """(title, unit, direction) of a summary metric, the balance losses' included."""
  if key in METRICS:
    return METRICS[key]
  if key.startswith(BALANCE_LOSS_LOG_PREFIX):
    return (key[len(BALANCE_LOSS_LOG_PREFIX):],
            "coefficient x loss, summed over MoE layers, second half of training", 0)
  raise KeyError(key)


def present(summary: Mapping, keys) -> list[str]:
  """The ``keys`` that at least one arm of ``summary`` has, in their order."""
  return [k for k in keys if any(k in a["metrics"] for a in summary["arms"].values())]


def skip_constant_zero(summary: Mapping, keys: list[str]) -> list[str]:
  """Drop columns that are exactly 0 for every arm (drop rate without capacity, var of top-k)."""
  keep = []
  for k in keys:
    vals = [a["metrics"][k]["interval"]["mean"] for a in summary["arms"].values()
            if k in a["metrics"]]
    if k in ("drop_rate", "active_experts_var") and all(v == 0 for v in vals):
      continue
    keep.append(k)
  return keep
