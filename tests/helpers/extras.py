"""The setup.py extras some tests need beyond `[test]`, and the one way a test says so: `@pytest.mark.extra(name)`.

`pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile` (the README's command) skips a marked test,
naming the extra to install; `.ci/run` then installs the extras and runs exactly the marked tests (`-m extra`).
A module whose imports need the extra declares it with `pytestmark = module_needs(name)`, which skips the whole
module at collection instead of breaking it. tests/test_install.py checks that no test skips for a missing extra
any other way (such a test would run in neither phase).
"""

import importlib.util

import pytest

# extra -> the module it installs that the tests need
EXTRAS = {"eval": "lm_eval", "tpu": "libtpu", "trl": "trl"}


def missing(extra: str) -> bool:
  """Whether the module of `extra` is not installed."""
  return importlib.util.find_spec(EXTRAS[extra]) is None


def reason(extra: str) -> str:
  """The skip message: the extra and the command that installs it."""
  return f"needs the [{extra}] extra: pip install -e '.[{extra}]'"


def module_needs(extra: str) -> pytest.MarkDecorator:
  """For `pytestmark = module_needs(extra)` at the top of a module that imports what `extra` installs: skips the
  module at collection when it is missing, else marks every test of the module for CI's extras phase."""
  if extra not in EXTRAS:
    raise ValueError(f"Unknown extra {extra!r}; the tests know {sorted(EXTRAS)}.")
  pytest.importorskip(EXTRAS[extra], reason=reason(extra))
  return pytest.mark.extra(extra)
