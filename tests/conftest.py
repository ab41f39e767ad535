"""Shared test setup: tests run on the CPU with float32 matmuls at full precision; trainer fixtures."""

import gc

import jax
import pytest
from helpers import extras

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_setup(item: pytest.Item) -> None:
  """A test marked `@pytest.mark.extra(name)` skips, naming the extra, when that extra is not installed."""
  for mark in item.iter_markers("extra"):
    (extra,) = mark.args
    if extra not in extras.EXTRAS:
      raise ValueError(
        f"{item.nodeid}: unknown extra {extra!r}; tests/helpers/extras.py knows {sorted(extras.EXTRAS)}."
      )
    if extras.missing(extra):
      pytest.skip(extras.reason(extra))


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
