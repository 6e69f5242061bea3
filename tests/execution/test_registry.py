"""The backend names: one registry, importable without JAX, matching the code."""

import subprocess
import sys

from moejax.execution import gmm, permute, registry


def test_registry_imports_without_jax():
  code = ("import sys, moejax.execution.registry as r; "
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m); "
          "print(r.GMM_BACKENDS)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert "blocked" in out.stdout


def test_every_name_has_an_implementation():
  assert gmm.BACKENDS == registry.GMM_BACKENDS
  assert gmm.DEFAULT_BACKEND == registry.DEFAULT_GMM_BACKEND in registry.GMM_BACKENDS
  for name in registry.GMM_BACKENDS:
    assert gmm.get_backend(name).name == name
  assert permute.GATHER_BACKENDS == registry.GATHER_BACKENDS


def test_package_exports_resolve_lazily():
  import moejax.execution as ex
  assert ex.BACKENDS == registry.GMM_BACKENDS
  assert ex.routed_experts.__module__ == "moejax.execution.grouped_ffn"
  from moejax.execution import tiling
  assert ex.tiling is tiling  # submodules resolve as attributes too
