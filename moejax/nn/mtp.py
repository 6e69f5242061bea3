"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, Sec. 2.2): D sequential modules.

Legend: B batch, S sequence length, d model width, V vocabulary, D depth
(``model.mtp_depth``), k = 1..D a module.

Module k predicts, at position i, the token k + 1 positions after the next
one (the main model predicts t_{i+1}; module 1 t_{i+2}). It reads the
previous depth's hidden state h^{k-1}_i (k = 1: the main model's last hidden
state, before its final norm) and the embedding of token t_{i+k}, the token
module k - 1 was asked to predict::

    h'_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      M_k: [2d, d]
    h^k  = TRM_k(h'_{1 .. S-k})                                  one causal block
    P^k  = OutHead(RMSNorm(h^k))                                 f32[B, S-k, V]

The embedding and the output head are the main model's (shared); each
module has its own two input norms, projection, transformer block and head
norm. Sequences shorten by one per depth (the last k positions have no
token t_{i+k} to read). The block's FFN is dense (width
``model.dense_ff_width``) or, with ``model.mtp_ffn='moe'``, an MoE layer
with its own experts, as DeepSeek-V3's MTP layer is: its layer aux goes
back to the model, which adds its balance losses to the objective and
gives its loads to its bias controller like a main layer's.

The loss (:func:`mtp_loss`) is the paper's eq. 24-25: L_k is the
cross-entropy of module k summed over its scored tokens and divided by the
tokens the main loss scores (the paper's 1/T), and the objective adds
lambda / D sum_k L_k. Inference never runs the modules
(:meth:`moejax.model.Transformer.__call__` computes them only with
``mtp=True``; decoding walks the main blocks).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn.losses import masked_cross_entropy
from moejax.topology import roles

# The logged name of the mean over depths of the modules' losses (before lambda).
LOG_NAME = "mtp/loss"


class MTPModule(nnx.Module):
  """One depth: (h^{k-1}[B, S', d], Emb(t_{i+k})[B, S', d], positions) -> h^k[B, S', d].

  ``block``: the module's transformer block (a :class:`moejax.model.Block`),
  built by the model, which owns the block type.
  """

  def __init__(self, d_model: int, block: nnx.Module, *, norm_eps: float, dtype,
               rngs: nnx.Rngs):
    norm = lambda: nnx.RMSNorm(d_model, epsilon=norm_eps, dtype=dtype, param_dtype=jnp.float32,
                               rngs=rngs)
    self.hidden_norm = norm()
    self.embed_norm = norm()
    self.proj = nnx.Linear(2 * d_model, d_model, use_bias=False, dtype=dtype,
                           param_dtype=jnp.float32, rngs=rngs)
    self.block = block
    self.head_norm = norm()

  def param_roles(self) -> dict:
    """The projection is a hidden matrix [2d, d]; the norms are element-wise (the block
    declares its own)."""
    return {"proj": {"kernel": roles.matrix("mtp")},
            **{n: roles.elementwise("norm") for n in ("hidden_norm", "embed_norm", "head_norm")}}

  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array,
               token_ids: jax.Array, **block_kw) -> tuple[jax.Array, Optional[dict]]:
    """-> (h^k [B, S', d], the block's MoE layer aux or None for a dense FFN).
    block_kw: the block's ``train`` / ``rng`` / ``axis_names``."""
    x = jnp.concatenate([self.hidden_norm(hidden), self.embed_norm(embedded)], axis=-1)
    return self.block(self.proj(x), positions, token_ids, **block_kw)


def forward(modules, hidden: jax.Array, tokens: jax.Array, embed: Callable, head: Callable,
            *, keys: Sequence[Optional[jax.Array]] = (), train: bool = False,
            axis_names: Sequence[str] = ()) -> tuple[tuple[jax.Array, ...], tuple]:
  """(the D modules' logits (f32[B, S-1, V], ..., f32[B, S-D, V]), their MoE aux).

  hidden: [B, S, d] the main model's last hidden state (before its final
  norm); tokens: int[B, S] its input; embed / head: the shared embedding and
  output head (the head applied after each module's own head norm); keys:
  one router-noise key per module (empty: none). The second element holds
  each module's MoE layer aux, None where its FFN is dense.
  """
  b, s = tokens.shape
  out, moe_aux = [], []
  for k, module in enumerate(modules, start=1):
    n = s - k
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    key = keys[k - 1] if keys else None
    hidden, aux = module(hidden[:, :n], embed(tokens[:, k:]), positions, tokens[:, k:],
                         train=train, rng=key, axis_names=axis_names)
    out.append(head(module.head_norm(hidden)))
    moe_aux.append(aux)
  return tuple(out), tuple(moe_aux)


def mtp_loss(logits: tuple, targets: jax.Array, mask: jax.Array,
             n_tokens: jax.Array) -> jax.Array:
  """(1 / D) sum_k L_k, f32[]: the mean over depths of each module's loss.

  logits: :func:`forward`'s; targets / mask: the main model's ([B, S]: the
  token after each position, and which are scored), so module k's targets
  are ``targets[:, k:]``; n_tokens: the tokens the main loss divides by.
  """
  losses = [masked_cross_entropy(lg, targets[:, k:], mask[:, k:])[1] / n_tokens
            for k, lg in enumerate(logits, start=1)]
  return jnp.mean(jnp.stack(losses))
