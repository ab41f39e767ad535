"""The curated top-level API, and how the package's modules import each other: one way, without circles, and
without matplotlib until something is drawn."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import refusion_jax as rj

LIBRARY_PACKAGES = (
  "model",
  "checkpoints",
  "decoding",
  "training",
  "evaluation",
  "benchmarks",
  "serving",
  "rl",
  "data",
  "parallel",
)


ENTRY_POINTS = ("train", "sample", "bench", "train_bench", "eval", "aot", "convert", "harness", "serve")


@pytest.mark.parametrize("name", rj.__all__)
def test_every_exported_name_is_the_object_its_module_defines(name):
  exported = getattr(rj, name)
  module = importlib.import_module(rj._EXPORTS[name])
  assert exported is getattr(module, name)
  if name == "PAPER_TASKS":  # the one exported table: method values
    assert all(isinstance(value, rj.ReFusion) for value in exported.values())
    return
  assert callable(exported) and exported.__module__.startswith("refusion_jax.")


def test_the_version_is_said_once():
  from refusion_jax import versions

  assert rj.__version__ == versions.__version__ == "0.3.0"
  assert "__version__" not in rj.__all__  # a module attribute, not an exported name


def test_internals_are_not_exported():
  for internal in ("KVCache", "BlockKV", "decode_reference", "inference_view", "decode_loop"):
    assert internal not in rj.__all__
    with pytest.raises(AttributeError, match=internal):
      getattr(rj, internal)


# Which packages each library package may import: entry points -> evaluation -> benchmarks -> serving / rl ->
# training/decoding -> checkpoints/data -> model/parallel, never back up (eval's runner times its batches with the
# benchmarks' timer). `deprecation.py` (old names forwarded with a warning) sits below them all.
BELOW_EVERY_PACKAGE = {"deprecation"}
ALLOWED_IMPORTS = {
  "model": {"model", "parallel"},
  "parallel": {"parallel", "model"},
  "data": {"data", "model"},
  "checkpoints": {"checkpoints", "data", "model", "parallel"},
  "decoding": {"decoding", "data", "model", "parallel"},
  "training": {"training", "decoding", "checkpoints", "data", "model", "parallel"},
  "serving": {"serving", "decoding", "data", "model", "parallel"},
  "rl": {"rl", "training", "decoding", "checkpoints", "data", "model", "parallel"},
  "benchmarks": {"benchmarks", "serving", "training", "decoding", "checkpoints", "data", "model", "parallel"},
  "evaluation": {
    "evaluation",
    "benchmarks",
    "serving",
    "training",
    "decoding",
    "checkpoints",
    "data",
    "model",
    "parallel",
  },
}


def test_imports_run_one_way():
  import pathlib
  import re

  root = pathlib.Path(rj.__file__).parent
  pattern = re.compile(r"(?:from|import) refusion_jax\.(\w+)|from refusion_jax import (\w+)")
  offenders = []
  for package, allowed in ALLOWED_IMPORTS.items():
    for path in (root / package).glob("*.py"):
      for match in pattern.finditer(path.read_text(encoding="utf-8")):
        target = match.group(1) or match.group(2)
        if target not in allowed | BELOW_EVERY_PACKAGE:
          offenders.append(f"{package}/{path.name} imports refusion_jax.{target}")
  for name in BELOW_EVERY_PACKAGE:
    offenders += [f"{name}.py imports {m}" for m in pattern.findall((root / f"{name}.py").read_text(encoding="utf-8"))]
  assert not offenders, offenders
  assert set(ALLOWED_IMPORTS) == set(LIBRARY_PACKAGES)


def test_no_module_imports_an_entry_point():
  import pathlib
  import re

  root = pathlib.Path(rj.__file__).parent
  names = "|".join(ENTRY_POINTS)
  pattern = re.compile(rf"(?:from|import) refusion_jax\.({names})\b|from refusion_jax import .*\b({names})\b")
  offenders = [
    f"{path.relative_to(root)} imports refusion_jax.{match.group(1) or match.group(2)}"
    for path in root.rglob("*.py")
    for match in pattern.finditer(path.read_text(encoding="utf-8"))
  ]
  assert not offenders, offenders
  # Beside the entry points only what they share (cli), what `import refusion_jax` runs (the jax window) and the
  # old-names helper below every package.
  assert {p.stem for p in root.glob("*.py")} == {"__init__", "cli", "versions", *BELOW_EVERY_PACKAGE, *ENTRY_POINTS}


def test_sub_packages_import_on_their_own():
  for package in LIBRARY_PACKAGES:
    importlib.import_module(f"refusion_jax.{package}")


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, int]]:
  """(module named, line) for every import statement in the file: at the top, inside functions, under
  TYPE_CHECKING; relative imports resolved; `from a import b` names both `a` and `a.b`."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
      found += [(base, node.lineno)] + [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
  return found


def import_circles(root: pathlib.Path) -> list[list[str]]:
  """Every circle of modules of the package at `root` that import each other, each as the import lines that close
  it ("a.py:12 imports b"). A package's `__init__.py` is left out: it gathers its modules' names, and a module
  reaching another through the package means that module."""
  files = {}
  for path in root.rglob("*.py"):
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    files[name.removesuffix(".__init__")] = path
  modules = {name for name, path in files.items() if path.name != "__init__.py"}
  edges: dict[str, dict[str, int]] = {name: {} for name in modules}
  for name in modules:
    for target, line in _imports(files[name], name):
      if target in modules and target != name:
        edges[name].setdefault(target, line)
  # Strongly connected components (Tarjan): each of more than one module is a circle.
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  circles = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
      if len(component) > 1:
        circles.append(
          sorted(
            f"{files[a].relative_to(root)}:{line} imports {b}"
            for a in component
            for b, line in edges[a].items()
            if b in component
          )
        )

  for name in sorted(modules):
    if name not in index:
      visit(name)
  return sorted(circles)


def test_import_circles_are_found_with_the_lines_that_close_them(tmp_path):
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  for path, text in {
    "__init__.py": "from pkg import a, b, c\n",
    "a.py": "import pkg.b\n",
    "b.py": "def late():\n  from pkg import a\n",  # inside a function
    "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from .sub import d\n",
    "sub/__init__.py": "",
    "sub/d.py": "from ..c import x\n",  # relative, two levels up
    "e.py": "import pkg.a\n",  # imports into a circle without closing one
  }.items():
    (package / path).write_text(text)
  assert import_circles(package) == [
    ["a.py:1 imports pkg.b", "b.py:2 imports pkg.a"],
    ["c.py:3 imports pkg.sub.d", "sub/d.py:1 imports pkg.c"],
  ]


def test_no_two_modules_import_each_other():
  """Counting imports inside functions and under TYPE_CHECKING. (The four circles of 0.2 -- model/lora <->
  model/transformer, checkpoints/load <-> checkpoints/lora_run, decoding/batching <-> decoding/contract,
  decoding/refusion <-> decoding/scheduler -- were each broken by moving the shared piece below both.)"""
  circles = import_circles(pathlib.Path(rj.__file__).parent)
  assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


_PLOTTING = "refusion_jax/decoding/trace_plot.py, refusion_jax/evaluation/curve.py, refusion_jax/evaluation/report.py"


def test_no_module_imports_matplotlib_until_it_draws():
  """Every module of the package imports without matplotlib (the plotting ones import it when they draw)."""
  root = pathlib.Path(rj.__file__).parent
  modules = sorted(".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py"))
  script = (
    "import importlib, sys\n"
    f"for name in {modules!r}:\n"
    "  try:\n"
    "    importlib.import_module(name.removesuffix('.__init__'))\n"
    "  except ModuleNotFoundError as missing:  # an extra not installed here (lm-eval, torch)\n"
    "    if missing.name.startswith('refusion_jax'):\n"
    "      raise\n"
    "  assert 'matplotlib' not in sys.modules, name\n"
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root.parent)
  assert out.returncode == 0, (
    f"importing this module imported matplotlib ({_PLOTTING} show how not to):\n" + (out.stderr[-2000:])
  )


def test_no_test_module_imports_another():
  """What tests share lives in tests/helpers/, so running one test module never runs (or collects) another."""
  tests = pathlib.Path(__file__).parent
  test_modules = {path.stem for path in tests.glob("test_*.py")}
  offenders = [
    f"{path.relative_to(tests)}:{line} imports {name}"
    for path in tests.rglob("*.py")
    for name, line in _imports(path, ".".join(path.relative_to(tests).with_suffix("").parts))
    if name.split(".")[0] == "tests" or name.split(".")[0] in test_modules or name.split(".")[0] == "conftest"
  ]
  assert not offenders, f"move what they share into tests/helpers/: {offenders}"
