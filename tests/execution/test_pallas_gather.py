"""The Pallas row gathers (TPU and GPU kernels, interpret mode here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import pallas_gather


@pytest.mark.parametrize("fn", [pallas_gather.gather_rows, pallas_gather.gather_rows_gpu])
def test_rows_and_sentinels_hand_computed(fn):
  x = jnp.arange(15.0).reshape(5, 3)            # row t is [3t, 3t+1, 3t+2]
  idx = jnp.array([4, 0, 5, 2, 9, 2, 1], jnp.int32)  # 5 and 9 are "no row" (>= T)
  want = np.array([[12, 13, 14], [0, 1, 2], [0, 0, 0], [6, 7, 8], [0, 0, 0],
                   [6, 7, 8], [3, 4, 5]], np.float32)
  np.testing.assert_array_equal(fn(x, idx, interpret=True), want)


def test_gpu_gather_pads_to_whole_blocks_and_back():
  # R = 70 rows and d = 200 are not whole (32, 128) blocks: padded, then cut.
  x = jax.random.normal(jax.random.PRNGKey(0), (37, 200)).astype(jnp.bfloat16)
  idx = jax.random.randint(jax.random.PRNGKey(1), (70,), 0, 45).astype(jnp.int32)
  got = pallas_gather.gather_rows_gpu(x, idx, interpret=True, block_rows=32,
                                      block_cols=128)
  want = jnp.take(x, idx, axis=0, mode="fill", fill_value=0)
  assert got.shape == (70, 200) and got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_empty_inputs():
  assert pallas_gather.gather_rows_gpu(jnp.ones((4, 3)), jnp.zeros((0,), jnp.int32)).shape \
      == (0, 3)
