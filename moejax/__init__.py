"""moejax: Mixture-of-Experts research in JAX/Flax.

``moejax.load(workdir)`` returns ``(model, config)`` of a trained run (see
:mod:`moejax.train.load`). Importing ``moejax`` itself imports nothing heavy.
``moejax.config``'s modules import no other moejax package; building a
config reads the registries of ideas (routers, layer kinds, balance rules),
which imports the planes that ship them on first use.
"""


def load(workdir: str, step=None):
  """(trained nnx model, ExperimentConfig) of the run in ``workdir`` (newest checkpoint).

  ``step``: another kept checkpoint. The model is a ``moejax.model.Transformer``
  with the checkpoint's params and router state.
  """
  from moejax.train.load import load as _load  # pylint: disable=g-import-not-at-top
  return _load(workdir, step)


__all__ = ["load"]
