"""setup.py gives each Python its jax line and the flax that imports under it; the extras and the install
commands of docs/install.md agree with it."""

import ast
import pathlib
import re
import runpy
import sys
import types
import warnings
from unittest import mock

import pytest
from packaging.requirements import Requirement

from refusion_jax import versions
from refusion_jax.versions import check_jax

REPO = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
  """The keyword arguments setup.py passes to `setuptools.setup` (a stand-in: a Python 3.12 venv has no setuptools)."""
  setuptools = types.SimpleNamespace(setup=mock.Mock(), find_packages=mock.Mock(return_value=[]))
  with mock.patch.dict(sys.modules, setuptools=setuptools), pytest.MonkeyPatch.context() as patch:
    patch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
  return setuptools.setup.call_args.kwargs


def requirement(requirements: list[str], name: str, python: str) -> Requirement:
  """The one requirement on `name` that applies under Python `python`."""
  found = [Requirement(r) for r in requirements]
  found = [r for r in found if r.name == name and (r.marker is None or r.marker.evaluate({"python_version": python}))]
  assert len(found) == 1, (name, python, found)
  return found[0]


# jax and flax releases the registry serves, and whether each pair imports (checked in fresh virtualenvs).
@pytest.mark.parametrize(
  "python, jax_ok, jax_refused, flax_ok, flax_refused",
  [
    ("3.11", ["0.10.2"], ["0.10.1", "0.11.0", "0.12.0.1"], ["0.12.8"], ["0.12.7", "0.13.0"]),
    # flax 0.12.8 fails to import under jax >= 0.11.1, flax 0.12.9 under jax >= 0.11.2.
    ("3.12", ["0.11.1", "0.11.2", "0.12.0.1"], ["0.10.2", "0.11.0", "0.13.0"], ["0.12.10", "0.12.12"], ["0.12.9"]),
    ("3.13", ["0.12.0.1"], ["0.10.2"], ["0.12.12"], ["0.12.8"]),
  ],
)
def test_each_python_gets_its_jax_line_and_a_flax_that_imports_under_it(
  setup_kwargs, python, jax_ok, jax_refused, flax_ok, flax_refused
):
  jax = requirement(setup_kwargs["install_requires"], "jax", python).specifier
  flax = requirement(setup_kwargs["install_requires"], "flax", python).specifier
  assert all(v in jax for v in jax_ok) and not any(v in jax for v in jax_refused), jax
  assert all(v in flax for v in flax_ok) and not any(v in flax for v in flax_refused), flax


@pytest.mark.parametrize("extra", ["tpu", "cuda12", "cuda13"])
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_accelerator_extras_pin_the_jax_of_the_base_install(setup_kwargs, extra, python):
  accelerated = requirement(setup_kwargs["extras_require"][extra], "jax", python)
  assert accelerated.extras == {extra}
  assert accelerated.specifier == requirement(setup_kwargs["install_requires"], "jax", python).specifier


def test_torch_comes_with_the_tests_on_python_3_11_only(setup_kwargs):
  assert requirement(setup_kwargs["extras_require"]["test"], "torch", "3.11").specifier == "==2.13.0"
  with pytest.raises(AssertionError):
    requirement(setup_kwargs["extras_require"]["test"], "torch", "3.12")


def test_the_no_deps_install_brings_every_other_requirement(setup_kwargs):
  """docs/install.md's command for a machine whose jax pip must not touch lists what setup.py requires besides jax."""
  page = (REPO / "docs" / "install.md").read_text()
  # The command, with its continuation lines.
  command = re.search(r"^    pip install -c /tmp/keep-jax.txt ((?:.*\\\n)*.*)$", page, re.M).group(1)
  listed = {Requirement(word.strip('"')).name for word in command.replace("\\\n", " ").split()}
  required = {Requirement(r).name for r in setup_kwargs["install_requires"]} - {"jax"}
  assert listed == required


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_gpu_extras_bring_tokamax_where_it_installs(setup_kwargs, python):
  for extra in ("cuda12", "cuda13", "test"):
    wanted = [Requirement(r) for r in setup_kwargs["extras_require"][extra]]
    tokamax = [r for r in wanted if r.name == "tokamax" and r.marker.evaluate({"python_version": python})]
    assert len(tokamax) == (python != "3.11"), (extra, python, tokamax)


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2", "0.12.1", "0.12.9rc1"])
def test_jax_in_the_window_imports_quietly(version):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    check_jax(version)


@pytest.mark.parametrize("version", ["0.10.1", "0.9.0", "0.4.38"])
def test_older_jax_is_refused_at_import_naming_the_window(version):
  with pytest.raises(ImportError, match=rf"0\.10\.2 <= jax < 0\.13, but jax {re.escape(version)} is installed"):
    check_jax(version)


@pytest.mark.parametrize("version", ["0.13.0", "0.13.0.dev20270101", "1.0"])
def test_newer_jax_is_named_with_the_tested_window(version):
  with pytest.warns(RuntimeWarning, match=rf"tested on 0\.10\.2 <= jax < 0\.13; jax {re.escape(version)} is newer"):
    check_jax(version)


def test_the_installed_jax_is_read_without_importing_it_and_is_in_the_window():
  import jax

  assert versions._installed_jax() == jax.__version__
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    check_jax()


# What shows that a test needs an extra (tests/helpers/extras.py): importing lm-eval or our harness over it, or TRL
# (at the module's top or in the test), or compiling for a TPU topology, which libtpu describes (in the test, or in
# a module constant it names).
EVAL_IMPORTS = re.compile(r"lm_eval(\..*)?|refusion_jax\.(evaluation\.)?harness")
TRL_IMPORTS = re.compile(r"trl(\..*)?")
TPU_CODE = re.compile(r"--topology=|topology_devices\(")


def _imported(nodes: list[ast.AST]) -> set[str]:
  """The modules these statements import (`from a import b` counts as `a.b` too: b may be a module)."""
  names = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
  return names


def _unmarked_needs(path: pathlib.Path) -> list[str]:
  """`file:test needs [extra]` for each test in `path` that needs an extra without `@pytest.mark.extra(extra)` on
  itself or `pytestmark = module_needs(extra)` on its module."""
  source = path.read_text(encoding="utf-8")
  tree = ast.parse(source)
  segment = lambda node: ast.get_source_segment(source, node) or ""
  constants = {
    target.id: segment(node)
    for node in tree.body
    if isinstance(node, ast.Assign)
    for target in node.targets
    if isinstance(target, ast.Name)
  }
  module_imports = _imported(tree.body)
  found = []
  for test in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
    named = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    code = "\n".join([segment(test), *(constants[name] for name in named & constants.keys())])
    needs = {
      "eval": any(EVAL_IMPORTS.fullmatch(name) for name in module_imports | _imported(list(ast.walk(test)))),
      "tpu": bool(TPU_CODE.search(code)),
      "trl": any(TRL_IMPORTS.fullmatch(name) for name in module_imports | _imported(list(ast.walk(test)))),
    }
    marks = constants.get("pytestmark", "") + "\n".join(segment(d) for d in test.decorator_list)
    for extra in (e for e, needed in needs.items() if needed):
      if f'extra("{extra}")' not in marks and f'module_needs("{extra}")' not in marks:
        found.append(f"{path.name}:{test.name} needs [{extra}]")
  return found


def test_every_test_that_needs_an_extra_is_marked_so_ci_runs_it():
  """A test needing lm-eval or libtpu carries `@pytest.mark.extra`: the README's command (`[test]` alone) skips it
  naming the extra, and .ci/run's extras phase (`-m extra`) runs it. A test that skipped for a missing extra any
  other way would run in neither phase of CI."""
  tests = REPO / "tests"
  unmarked = [found for path in sorted(tests.glob("test_*.py")) for found in _unmarked_needs(path)]
  assert not unmarked, f"mark them @pytest.mark.extra(name) (tests/helpers/extras.py): {unmarked}"
  own_skip = re.compile(r"""(importorskip|find_spec)\(\s*["'](lm_eval|libtpu|trl)""")
  offenders = [str(p.relative_to(tests)) for p in tests.rglob("*.py") if own_skip.search(p.read_text(encoding="utf-8"))]
  assert offenders == [], f"skip for a missing extra through helpers/extras.py, not by hand: {offenders}"
