"""Shared test setup: tests run on the CPU with float32 matmuls at full precision; trainer fixtures."""

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """One built task dataset for the whole module."""
  return str(tmp_path_factory.mktemp("data"))
