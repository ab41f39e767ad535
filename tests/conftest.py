"""Shared test setup: tests run on the CPU with float32 matmuls at full precision; trainer fixtures."""

import gc

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Free each module's compiled programs when it ends.

  Every CPU executable holds its own memory mappings, and the whole suite in one process compiles
  enough programs to pass Linux's default limit of 65,530 mappings (the count passed 22,000 a fifth of
  the way in), after which XLA aborts or segfaults inside a compile, far from the cause. Modules rarely
  share a program, so this costs little recompilation.
  """
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """One built task dataset for the whole module."""
  return str(tmp_path_factory.mktemp("data"))
