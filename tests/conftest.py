"""Shared test setup: tests run on the CPU with float32 matmuls at full precision; trainer fixtures."""

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """One built task dataset for the whole module."""
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """Runs of the same config compile the same programs: reuse them across a module's tests."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  previous = {key: getattr(jax.config, key) for key in keys}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  yield
  for key, value in previous.items():
    jax.config.update(key, value)
