"""An executable read back from the run's compilation cache computes the same bits.

tests/conftest.py shares one persistent compilation cache between all the
tests and the binaries they launch, so most compiled programs of a run come
from the cache; a cached executable must give exactly the numbers a fresh
compile gives, or the golden and bit-identity tests would test the cache.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def _new_program():
  """A new function object each call (its own in-memory jit cache), the same program each
  time: a small MLP step, (B, D) @ (D, D) twice, then a softmax, a sum and a gradient."""
  def _program(w, x):
    h = jax.nn.gelu(x @ w)
    y = jax.nn.softmax(h @ w.T, axis=-1)
    return jnp.sum(y * x, axis=-1), jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  return _program


def test_cached_executable_gives_the_bits_of_a_fresh_compile(compilation_cache):
  cache_dir = compilation_cache["JAX_COMPILATION_CACHE_DIR"]
  hits = []
  listener = lambda event, **_: hits.append(event)
  jax.monitoring.register_event_listener(listener)
  previous = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even this one
  try:
    w = jax.random.normal(jax.random.key(0), (16, 16), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
    before = set(os.listdir(cache_dir))
    fresh = jax.jit(_new_program())(w, x)
    written = set(os.listdir(cache_dir)) - before
    assert any(name.startswith("jit__program") for name in written), written
    del hits[:]
    cached = jax.jit(_new_program())(w, x)  # not in memory: compiled, or read from the file
    assert "/jax/compilation_cache/cache_hits" in hits
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
    jax.monitoring.unregister_event_listener(listener)  # pylint: disable=no-member
  for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(cached)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
