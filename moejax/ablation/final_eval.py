"""The final whole-split evaluation of an ablation run, per document, and the routing sample.

Legend: N validation documents, E_r routed columns, D domains.

:func:`final_evaluation` restores a run's last checkpoint and evaluates it
once over the whole validation split with
:func:`moejax.evaluate.validation.make_eval_step` (``num_docs=N``);
:func:`evaluate_state` does the same for a state in memory (the runner hands
it to the trainer, which then reads the split once, not twice: its own
final evaluation row is this one). One pass gives:

- the run's final metrics (validation loss, MaxVio_global, I(expert; domain)),
  the numbers of the suite summary;
- per document the cross-entropy sum and the target count, f64[N] each,
  written to ``<run>/per_doc_loss.npz`` (``ce_sum``, ``count``) for the
  document bootstrap of :mod:`moejax.ablation.stats`;
- per MoE layer the (expert, domain) counts f[E_r, D] and the load, written
  to ``routing.json`` (``layers.<layer>.joint`` / ``final_load``): the routing
  notebook draws P(domain | expert) from exactly the counts the summary's
  specialisation number comes from;
- each token's experts of the same forward, accumulated as
  :func:`moejax.ablation.analysis.routing_pass` does (load, joint,
  co-activation, the ids of the all-to-all accounting): the final
  checkpoint's routing pass over the whole split, without a second forward.

:func:`routing_sample` picks the validation batches of the per-checkpoint
routing pass (load over training, co-activation): the whole split, or
``n`` batches evenly spaced over it (a stratified sample of the split's
files in stored order, not its first few files).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax import data as data_lib
from moejax.ablation import analysis as analysis_lib
from moejax.evaluate import validation
from moejax.train import processes
from moejax.train import step as step_lib
from moejax.train.config import ExperimentConfig

PER_DOC_FILE = "per_doc_loss.npz"


@dataclasses.dataclass(frozen=True)
class FinalEval:
  metrics: dict            # validation.summarise(...) of the whole split
  doc_ce: np.ndarray       # f64[N]
  doc_count: np.ndarray    # f64[N]
  joints: dict             # {layer: f64[E_r, D]}
  loads: dict              # {layer: f64[E]}
  step: int
  domain_ce: Optional[np.ndarray] = None     # f64[D] CE sum per domain (every valid target)
  domain_count: Optional[np.ndarray] = None  # f64[D]
  domain_names: tuple = ()
  routing: Optional[dict] = None  # routing_pass(...) of the whole split, same forward


def _graphdef(exp: ExperimentConfig):
  from moejax.train.optim import make_optimizer  # pylint: disable=g-import-not-at-top
  graphdef, _ = step_lib.abstract_state(exp, make_optimizer(exp.train, exp.model))
  return graphdef


def final_evaluation(exp: ExperimentConfig, run_path: str) -> FinalEval:
  """The whole-split evaluation of the run's last checkpoint (see the module doc)."""
  model, step = analysis_lib.load_model(exp, run_path)
  graphdef, params, router_state, other = step_lib.split_model(model)
  return evaluate_state(exp, params, router_state, other, int(step), graphdef)


def evaluate_state(exp: ExperimentConfig, params, router_state, other, step: int,
                   graphdef=None) -> FinalEval:
  """The whole-split evaluation of a state (pure-dict params, router state, other).

  The state may live on any devices (the trainer's mesh, over several
  processes): it is read whole to the host first and evaluated with the
  single-device model of ``exp``; every process of a multi-process run calls
  this with its part of the same state and gets the same evaluation.
  """
  if graphdef is None:
    graphdef = _graphdef(exp)
  # Whole on every process of a multi-process run (each evaluates the same split alike).
  params, router_state, other = processes.host_tree((params, router_state, other))
  docs = data_lib.load_documents(exp.data, exp.data.eval_split)
  eval_step = validation.make_eval_step(graphdef, exp.model, len(docs.domain_names),
                                        num_docs=len(docs), with_routing=True)
  batches = data_lib.make_batch_iterator(docs, exp.data.seq_len, exp.data.batch_size,
                                         seed=exp.data.seed, train=False,
                                         loss_labels=data_lib.loss_labels(exp.data, docs))
  totals, routing = None, {}
  for batch in batches:
    sums, ids = eval_step(params, router_state, other, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if exp.model.moe is not None:
      analysis_lib.add_routing(routing, jax.device_get(ids), batch, exp,
                               len(docs.domain_names))
  if totals is None:
    raise ValueError("final evaluation: the validation split gave no batch; check "
                     "data.eval_split and that the split holds at least one token")
  totals = {k: np.asarray(v) for k, v in jax.device_get(totals).items()}
  layers = lambda prefix: {k.split("/", 1)[1]: np.asarray(v, np.float64)
                           for k, v in totals.items() if k.startswith(prefix)}
  return FinalEval(metrics=validation.summarise(totals, docs.domain_names),
                   doc_ce=np.asarray(totals["doc_ce"], np.float64),
                   doc_count=np.asarray(totals["doc_count"], np.float64),
                   joints=layers("joint/"), loads=layers("load/"), step=int(step),
                   domain_ce=np.asarray(totals["domain_ce"], np.float64),
                   domain_count=np.asarray(totals["domain_count"], np.float64),
                   domain_names=tuple(docs.domain_names), routing=routing)


def write_per_doc(run_path: str, ev: FinalEval) -> str:
  path = os.path.join(run_path, PER_DOC_FILE)
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, ce_sum=ev.doc_ce, count=ev.doc_count)
  os.replace(tmp, path)
  return path


def read_per_doc(run_path: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
  """(ce_sum f64[N], count f64[N]) of a run, or None when it has none (older runs)."""
  path = os.path.join(run_path, PER_DOC_FILE)
  if not os.path.exists(path):
    return None
  with np.load(path) as f:
    return np.asarray(f["ce_sum"], np.float64), np.asarray(f["count"], np.float64)


def routing_sample(exp: ExperimentConfig, num: Optional[int]):
  """(batches, domain names, description) of the routing pass: see the module doc."""
  docs = data_lib.load_documents(exp.data, exp.data.eval_split)
  it = data_lib.make_batch_iterator(docs, exp.data.seq_len, exp.data.batch_size,
                                    seed=exp.data.seed, train=False)
  total = len(it)
  if num is None or num >= total:
    keep, what = set(range(total)), f"the whole validation split ({total} batches)"
  else:
    keep = {int(i) for i in np.linspace(0, total - 1, num).round()}
    what = (f"{len(keep)} of the {total} validation batches, evenly spaced over the split "
            "(analysis.routing_batches)")
  batches = [b for i, b in enumerate(it) if i in keep]
  return batches, list(docs.domain_names), what
