"""The README's module map names every module, config and launch script, and the public API it lists is the real one."""

import ast
import inspect
import pathlib
import re

import refusion_jax as rj

ROOT = pathlib.Path(__file__).parents[1]


def _map_rows() -> dict[str, str]:
  """{first cell: the whole row} of the README's "where | what it holds" table."""
  text = (ROOT / "README.md").read_text()
  table = text[text.index("| where | what it holds |") :].split("\n\n")[0]
  rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
  return {row.split("|")[1].strip(): row for row in rows}


def _row_for(rows: dict[str, str], where: str) -> str:
  matches = [row for first, row in rows.items() if first.startswith(f"`{where}")]
  assert len(matches) == 1, f"the README's module map has no row for {where}"
  return matches[0]


def test_every_module_is_in_the_readme_map():
  rows = _map_rows()
  missing = []
  for package in sorted(p for p in (ROOT / "refusion_jax").iterdir() if (p / "__init__.py").exists()):
    row = _row_for(rows, f"refusion_jax/{package.name}/")
    missing += [
      f"{package.name}/{m.name}" for m in package.glob("*.py") if m.name != "__init__.py" and f"`{m.name}`" not in row
    ]
  top = " ".join(
    row for first, row in rows.items() if first.startswith(("`refusion_jax/__init__", "`refusion_jax/train.py"))
  )
  missing += [m.name for m in (ROOT / "refusion_jax").glob("*.py") if not re.search(rf"[`/]{re.escape(m.name)}`", top)]
  for folder in ("configs", "launch"):
    row = _row_for(rows, f"{folder}/")
    missing += [f"{folder}/{f.name}" for f in (ROOT / folder).iterdir() if f.is_file() and f"`{f.name}`" not in row]
  assert not missing, f"not in the README's module map: {missing}"


def test_the_readme_lists_the_public_api():
  row = _row_for(_map_rows(), "refusion_jax/__init__.py")
  listed = set(re.findall(r"`(\w+)`", row.split("|")[2]))
  assert listed == set(rj.__all__), (
    f"README lists {sorted(listed - set(rj.__all__))} but not {sorted(set(rj.__all__) - listed)}"
  )


def test_the_readme_calls_only_public_names():
  text = (ROOT / "README.md").read_text()
  called = set(re.findall(r"\brj\.(\w+)\(", text))
  assert called <= set(rj.__all__), sorted(called - set(rj.__all__))


def test_architecture_quotes_the_decoder_contract_as_the_code_defines_it():
  from refusion_jax.decoding import contract

  defined = ast.parse(inspect.getsource(contract.Method)).body[0]
  defined.body = [node for node in defined.body if not isinstance(node, ast.Expr)]  # the docstring
  doc = (ROOT / "docs" / "architecture.md").read_text()
  section = doc[doc.index("## 4.") : doc.index("## 5.")]
  quoted = section[section.index("```python\n") + len("```python\n") :].split("```")[0]
  assert ast.dump(ast.parse(quoted).body[0]) == ast.dump(defined), "docs/architecture.md §4 misquotes contract.Method"
