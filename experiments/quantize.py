r"""Weight-only int8 / int4 expert quantisation: validation loss, routing and memory.

Usage:
  python -m experiments.quantize --workdir=/tmp/moejax_default \
      --json_out=results/serving/quantization.json
  python -m experiments.quantize --hf_model_type=mixtral --hf_train_steps=300   # needs .[interop]

For a trained moejax run (``--workdir``, the latest checkpoint) and/or a
tiny Hugging Face MoE LM (``--hf_model_type``: built from its transformers
config, trained ``--hf_train_steps`` AdamW steps in torch on the same byte
data, then its MoE blocks imported through ``moejax.interop``), for each
scheme of ``--schemes`` (``int8``, ``int4``: one scale per output channel;
``int4_g32``: one per 32 input rows), with expert weights quantised by
:mod:`moejax.serve.quantize` (router, embeddings, norms, attention in
float32):

  * ``val_loss``: mean next-token cross-entropy (nats / byte) over
    ``--num_batches`` validation batches, and its change from float;
  * ``routing_changed``: fraction of (token, MoE layer) pairs whose top-k
    expert *set* differs from the float model's, every layer fed its own
    (quantised) model's input, so upstream errors compound as in serving;
  * ``top1_agree``: fraction of positions whose argmax next token is the
    float model's;
  * bytes: expert weights and the whole parameter state, float32 vs
    quantised (codes at bits / 8 bytes, int4 packed, plus float16 scales).

The HF model runs in torch with each MoE block's output replaced (forward
hook) by the imported moejax layer's, so the float row is moejax's
imported layer (its HF parity is reported as ``hf_parity_max_abs``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import common_flags
from experiments import cli, serving_tables
from moejax.serve import quantize as quant_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "a trained moejax run to quantise")
_HF_TYPE = flags.DEFINE_string("hf_model_type", None, "tiny HF family to train and import "
                               "(mixtral, qwen2_moe, qwen3_moe, deepseek_v3)")
_HF_STEPS = flags.DEFINE_integer("hf_train_steps", 300, "torch AdamW steps for the HF model")
_HF_WIDTH = flags.DEFINE_integer("hf_hidden_size", 64, "hidden size of the tiny HF model")
_HF_LAYERS = flags.DEFINE_integer("hf_layers", 4, "decoder layers of the tiny HF model")
_SCHEMES = flags.DEFINE_list("schemes", ["int8", "int4", "int4_g32"],
                             "int<bits>[_g<group>] schemes")
_BATCHES = flags.DEFINE_integer("num_batches", 20, "validation batches")
_JSON = common_flags.json_out()
_SEED = common_flags.seed()  # of the HF model and its training


def parse_scheme(text: str) -> quant_lib.QuantConfig:
  try:
    return quant_lib.QuantConfig.parse(text)
  except ValueError as e:
    raise app.UsageError(f"--schemes: {e}") from e


def _ce(logits, targets, mask):
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
  m = jnp.asarray(mask, jnp.float32)
  return float(jnp.sum(nll * m)), float(jnp.sum(m))


def _sets_changed(ids_a, valid_a, ids_b, valid_b, mask) -> tuple[int, int]:
  """(tokens whose valid expert set differs, tokens) over a [B, S, K] routing pair."""
  def sets(ids, valid):
    ids = np.where(np.asarray(valid, bool), np.asarray(ids), -1)
    return np.sort(ids, axis=-1)
  diff = np.any(sets(ids_a, valid_a) != sets(ids_b, valid_b), axis=-1)
  m = np.asarray(mask, bool)
  return int(diff[m].sum()), int(m.sum())


def _summary(rows: dict, base: str = "float") -> None:
  for r in rows.values():
    r["val_loss_delta"] = r["val_loss"] - rows[base]["val_loss"]


# --- moejax runs. -------------------------------------------------------------

def _moejax_pass(model, batches):
  graphdef, state = nnx.split(model)
  out = []
  for batch in batches:
    logits, aux = quant_lib.forward_split(graphdef, state, jnp.asarray(batch["inputs"]))
    routing = {k: (v["expert_ids"], v["valid"]) for k, v in aux["moe"].items()
               if "expert_ids" in v}
    out.append((np.asarray(logits), jax.tree.map(np.asarray, routing)))
  return out


def moejax_rows(workdir: str, schemes) -> dict:
  from moejax.ablation.analysis import load_model, val_batches
  from moejax.train.load import run_config

  cfg = run_config(workdir)
  batches, _ = val_batches(cfg, _BATCHES.value)
  model, step = load_model(cfg, workdir)
  float_bytes = quant_lib.weight_bytes(nnx.state(model, nnx.Param))
  expert_float = _expert_bytes(model)
  ref = _moejax_pass(model, batches)
  rows = {}
  for label, qcfg in [("float", None)] + [(s, parse_scheme(s)) for s in schemes]:
    m = model if qcfg is None else quant_lib.quantize_model(load_model(cfg, workdir)[0], qcfg)
    got = ref if qcfg is None else _moejax_pass(m, batches)
    loss = count = changed = routed = agree = 0.0
    for batch, (logits, routing), (ref_logits, ref_routing) in zip(batches, got, ref):
      l, c = _ce(logits, batch["targets"], batch["mask"])
      loss, count = loss + l, count + c
      mask = np.asarray(batch["mask"], bool)
      agree += float(np.sum((logits.argmax(-1) == ref_logits.argmax(-1)) & mask))
      for name, (ids, valid) in routing.items():
        d, n = _sets_changed(ids, valid, *ref_routing[name], mask)
        changed, routed = changed + d, routed + n
    wb = quant_lib.weight_bytes(nnx.state(m, nnx.Param))
    rows[label] = {"val_loss": loss / count, "routing_changed": changed / max(routed, 1),
                   "top1_agree": agree / count, "param_bytes": wb["total"],
                   "expert_bytes": _expert_bytes(m), "tokens": count}
  _summary(rows)
  return {"workdir": workdir, "step": step, "model": dataclasses.asdict(cfg.model),
          "float_param_bytes": float_bytes["total"], "float_expert_bytes": expert_float,
          "rows": rows}


def _expert_bytes(model) -> int:
  groups = []
  for ffn in quant_lib.moe_ffns(model):
    groups += [ffn.params.get("experts"), ffn.params.get("shared")]
  seen, total = set(), 0
  for g in groups:
    for key in ("w_gate_up", "w_gate", "w_up", "w_down"):
      v = None if g is None else g.get(key)
      if v is not None and id(v) not in seen:
        seen.add(id(v))
        total += quant_lib.weight_bytes({"w": v})["total"]
  return total


# --- A tiny HF model, trained in torch, imported. ------------------------------

def _train_hf(model, data_cfg, steps: int, seed: int):
  import torch
  from moejax import data as data_lib

  torch.manual_seed(seed)
  opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
  sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps,
                                              pct_start=0.05)
  it = data_lib.make_batches(data_cfg, data_cfg.train_split)
  model.train()
  losses = []
  for _ in range(steps):
    batch = next(it)
    out = model(input_ids=torch.as_tensor(batch["inputs"], dtype=torch.long),
                labels=None)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        torch.as_tensor(batch["targets"], dtype=torch.long).reshape(-1), reduction="none")
    loss = (loss * torch.as_tensor(batch["mask"], dtype=torch.float32).reshape(-1)).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    losses.append(loss.item())
  model.eval()
  return losses


def hf_rows(model_type: str, schemes) -> dict:
  import torch
  from moejax import data as data_lib
  from moejax.interop import families as fam
  from moejax.interop import hf_models
  from moejax.interop.convert import import_moe_block
  from moejax.layer import moe_layer

  d = _HF_WIDTH.value
  model = hf_models.tiny_model(model_type, seed=_SEED.value, hidden_size=d,
                               intermediate_size=2 * d, num_attention_heads=4,
                               num_hidden_layers=_HF_LAYERS.value,
                               num_key_value_heads=2,
                               **({"moe_intermediate_size": d} if model_type != "mixtral"
                                  else {}))
  data_cfg = data_lib.DataConfig(name="python_stdlib", seq_len=128, batch_size=16, seed=0)
  losses = _train_hf(model, data_cfg, _HF_STEPS.value, _SEED.value)
  layers = fam.moe_layers(model.config)
  sd = model.state_dict()
  blocks = {i: import_moe_block(sd, model.config, layer=i) for i in layers}
  docs_cfg = dataclasses.replace(data_cfg, batch_size=16)
  batches = []
  for i, b in enumerate(data_lib.make_batches(docs_cfg, docs_cfg.eval_split, train=False)):
    if i >= _BATCHES.value:
      break
    batches.append(b)
  apply = jax.jit(lambda p, x, s, cfg: moe_layer(p, x, s, cfg), static_argnums=3)

  def run(params_by_layer):
    """Logits and routing of every batch with each MoE block replaced by the moejax layer."""
    routing, parity = {}, [0.0]

    def hook(i):
      def fn(_module, args, out):
        y_hf = out[0] if isinstance(out, tuple) else out
        x = jnp.asarray(args[0].detach().float().numpy())
        y, aux = apply(params_by_layer[i], x, blocks[i].state, blocks[i].cfg)
        b, s = x.shape[:2]
        routing[i] = (np.asarray(aux.routing.expert_ids).reshape(b, s, -1),
                      np.asarray(aux.routing.valid).reshape(b, s, -1))
        parity[0] = max(parity[0], float(np.max(np.abs(np.asarray(y) -
                                                       y_hf.detach().float().numpy()))))
        new = torch.from_numpy(np.array(y, np.float32))
        return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new
      return fn

    handles = [hf_models.block_module(model, i).register_forward_hook(hook(i)) for i in layers]
    outs = []
    try:
      with torch.no_grad():
        for batch in batches:
          routing.clear()
          logits = model(input_ids=torch.as_tensor(batch["inputs"], dtype=torch.long)).logits
          outs.append((logits.float().numpy(), dict(routing)))
    finally:
      for h in handles:
        h.remove()
    return outs, parity[0]

  float_params = {i: blk.params for i, blk in blocks.items()}
  ref, parity = run(float_params)
  expert_float = sum(quant_lib.weight_bytes({k: p[k] for k in ("experts", "shared") if k in p})
                     ["total"] for p in float_params.values())
  rows = {}
  for label, qcfg in [("float", None)] + [(s, parse_scheme(s)) for s in schemes]:
    if qcfg is None:
      got, qbytes = ref, expert_float
    else:
      qparams = {i: quant_lib.quantize_params(p, qcfg) for i, p in float_params.items()}
      qbytes = sum(quant_lib.weight_bytes({k: p[k] for k in ("experts", "shared") if k in p})
                   ["total"] for p in qparams.values())
      got, _ = run({i: quant_lib.dequantize_params(p) for i, p in qparams.items()})
    loss = count = changed = routed = agree = 0.0
    for batch, (logits, routing), (ref_logits, ref_routing) in zip(batches, got, ref):
      l, c = _ce(logits, batch["targets"], batch["mask"])
      loss, count = loss + l, count + c
      mask = np.asarray(batch["mask"], bool)
      agree += float(np.sum((logits.argmax(-1) == ref_logits.argmax(-1)) & mask))
      for i, (ids, valid) in routing.items():
        dd, n = _sets_changed(ids, valid, *ref_routing[i], mask)
        changed, routed = changed + dd, routed + n
    rows[label] = {"val_loss": loss / count, "routing_changed": changed / max(routed, 1),
                   "top1_agree": agree / count, "expert_bytes": qbytes, "tokens": count}
  _summary(rows)
  return {"model_type": model_type, "hidden_size": d, "layers": _HF_LAYERS.value,
          "train_steps": _HF_STEPS.value,
          "train_loss_first_last": [losses[0], float(np.mean(losses[-20:]))],
          "moe_layers": layers, "moe_cfg": dataclasses.asdict(blocks[layers[0]].cfg),
          "hf_parity_max_abs": parity, "float_expert_bytes": expert_float, "rows": rows}


def print_table(title: str, res: dict) -> None:
  print(f"\n{title}")
  print(f"{'scheme':<10}{'val loss':>10}{'delta':>10}{'routing changed':>17}{'top-1 agree':>13}"
        f"{'expert MB':>11}{'saved':>8}")
  base = res["float_expert_bytes"]
  for label, r in res["rows"].items():
    print(f"{label:<10}{r['val_loss']:>10.4f}{r['val_loss_delta']:>+10.4f}"
          f"{100 * r['routing_changed']:>16.2f}%{100 * r['top1_agree']:>12.2f}%"
          f"{r['expert_bytes'] / 1e6:>11.3f}{100 * (1 - r['expert_bytes'] / base):>7.1f}%")
  print("\n" + serving_tables.quantization_table(res))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value and not _HF_TYPE.value:
    raise app.UsageError("give --workdir=RUN and/or --hf_model_type=mixtral")
  schemes = list(_SCHEMES.value)
  for s in schemes:
    parse_scheme(s)
  cli.check_writable_file("--json_out", _JSON.value)  # before the run is loaded
  out = {}
  if _WORKDIR.value:
    # pylint: disable=g-import-not-at-top
    from moejax.config import ConfigError
    from moejax.train.checkpoint import WorkdirError
    try:
      out["moejax"] = moejax_rows(_WORKDIR.value, schemes)
    except (ConfigError, WorkdirError) as e:  # not a run, or one this moejax cannot build
      cli.fail(f"{type(e).__name__}: {e}")
    r = out["moejax"]
    print_table(f"moejax run {r['workdir']} (step {r['step']}); whole model "
                f"{r['float_param_bytes'] / 1e6:.2f} MB float32 -> "
                + ", ".join(f"{k} {v['param_bytes'] / 1e6:.2f} MB" for k, v in r["rows"].items()
                            if k != "float"), r)
  if _HF_TYPE.value:
    out["hf"] = hf_rows(_HF_TYPE.value, schemes)
    r = out["hf"]
    print_table(f"HF {r['model_type']} (d={r['hidden_size']}, {r['layers']} layers, trained "
                f"{r['train_steps']} steps, loss {r['train_loss_first_last'][0]:.3f} -> {r['train_loss_first_last'][1]:.3f}); "
                f"imported layers' max |y - y_HF| = {r['hf_parity_max_abs']:.1e}", r)
  if _JSON.value:
    with open(cli.file_to_write(_JSON.value), "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1, default=float)
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  cli.run(main)
