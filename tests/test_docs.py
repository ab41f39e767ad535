"""The docs keep their promises: the README is short, opens with the two set-up commands and links pages that
exist; the module map (docs/modules.md) names every module, config and launch script, and the public API it lists
is the real one; nothing the package ships uses a name or call form that a release removed (CHANGELOG.md)."""

import ast
import inspect
import pathlib
import re
import subprocess

import refusion_jax as rj
from refusion_jax.deprecation import REMOVED_IN

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
MODULE_MAP = ROOT / "docs" / "modules.md"
# The pages the README's tour points a newcomer to.
DOCS_PAGES = ("install", "training", "sampling", "checkpoints", "lora", "evaluation", "scaling", "modules")


def _map_rows() -> dict[str, str]:
  """{first cell: the whole row} of docs/modules.md's "where | what it holds" table."""
  text = MODULE_MAP.read_text()
  table = text[text.index("| where | what it holds |") :].split("\n\n")[0]
  rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
  return {row.split("|")[1].strip(): row for row in rows}


def _row_for(rows: dict[str, str], where: str) -> str:
  matches = [row for first, row in rows.items() if first.startswith(f"`{where}")]
  assert len(matches) == 1, f"docs/modules.md has no row for {where}"
  return matches[0]


def test_every_module_is_in_the_module_map():
  rows = _map_rows()
  missing = []
  for package in sorted(p for p in (ROOT / "refusion_jax").iterdir() if (p / "__init__.py").exists()):
    row = _row_for(rows, f"refusion_jax/{package.name}/")
    missing += [
      f"{package.name}/{m.name}" for m in package.glob("*.py") if m.name != "__init__.py" and f"`{m.name}`" not in row
    ]
  # The rows of top-level modules (the public API, the entry points, deprecation.py) name them by file.
  top = " ".join(row for first, row in rows.items() if re.match(r"`refusion_jax/\w+\.py`", first))
  missing += [m.name for m in (ROOT / "refusion_jax").glob("*.py") if not re.search(rf"[`/]{re.escape(m.name)}`", top)]
  for folder in ("configs", "launch"):
    row = _row_for(rows, f"{folder}/")
    missing += [f"{folder}/{f.name}" for f in (ROOT / folder).iterdir() if f.is_file() and f"`{f.name}`" not in row]
  assert not missing, f"not in docs/modules.md: {missing}"


def test_the_module_map_lists_the_public_api():
  row = _row_for(_map_rows(), "refusion_jax/__init__.py")
  listed = set(re.findall(r"`(\w+)`", row.split("|")[2]))
  assert listed == set(rj.__all__), (
    f"docs/modules.md lists {sorted(listed - set(rj.__all__))} but not {sorted(set(rj.__all__) - listed)}"
  )


def test_the_docs_name_only_public_names():
  for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
    unknown = sorted(set(re.findall(r"\brj\.(\w+)", page.read_text())) - set(rj.__all__))
    assert not unknown, f"{page.name} names rj.{', rj.'.join(unknown)}, which refusion_jax does not export"


# What 0.3 removed (CHANGELOG.md), as it would be written -> what replaces it. A pattern names a removed spelling and
# nothing current (`parse_mesh` but not `parse_mesh_spec`, `batching.Batch` but not a docstring's "Batch:"), and
# opens with literal text, which `re` finds fast; a match counts where it starts a word.
_METHOD_FIELDS = "gen_length|slot_size|serial_blocks|slot_threshold|token_threshold|block_length|steps|temperature"
REMOVED_IN_0_3 = {
  r"rj\.generate\b": "rj.decode(model, ids, rj.ReFusion(...))",
  r"refusion_jax\.generate\b": "rj.decode(model, ids, rj.ReFusion(...))",
  r"refusion\.generate\b": "rj.decode(model, ids, rj.ReFusion(...))",
  r"ar_generate\b": "rj.decode(model, ids, rj.AR(...))",
  r"mdm_generate\b": "rj.decode(model, ids, rj.MDM(...))",
  r"load_checkpoint\b": "rj.load_model",
  r"load_hf\b": 'rj.load_model(path, format="hf")',
  r"refusion\.REFUSION\b": "rj.ReFusion",
  r"refusion\.pick_rows_on\b": "decoding.mesh.pick_rows_on",
  r"picks_rows\b": "decoding.mesh.pick_rows_on",
  r"MDMSchedule\b": "decoding.mdm.MDMSettings",
  r"batching\.Batch\b": "decoding.batching.LoopState",
  r"mesh\.batch_shardings\b": "decoding.mesh.loop_shardings",
  r"sampler\.METHODS\b": "decoding.methods.METHODS",
  r"decoder_options\b": "dataclasses.fields(method_class)",
  r"decoding[./]driver\b": "decoding/engine.py (Engine, decode), loop.py (the compiled loop), programs.py (caches)",
  r"\bServingEngine\b": "serving.worker.DecodeWorker",
  r"decoding[./]defaults\b": "the method classes' defaults (rj.ReFusion(), rj.MDM(gen_length=G))",
  r"decoding import [\w, ]*\bdefaults\b": "the method classes' defaults (rj.ReFusion(), rj.MDM(gen_length=G))",
  r"defaults\.(?:GEN_LENGTH|REFUSION|MDM_BLOCK_LENGTH|mdm_block_length|mdm_steps)\b": "the method classes' defaults",
  r"method_defaults\b": "dataclasses.asdict(decoding.methods.method_value(name, ...))",
  r"harness\.PAPER_GEN_LENGTH\b": "decoding.paper.PAPER_GEN_LENGTH",
  r"REFUSION_KNOBS\b": "the fields of rj.ReFusion (the harness takes every registered method's fields)",
  r"parse_mesh\b": "parallel.mesh_spec.parse_mesh_spec",
  r"ReFusionOptions\b": "rj.ReFusion",
  r"decode_settings\b": "evaluation.sweep.method_sweep",
  r"eval\.(?:load_examples|default_label)\b": "evaluation.test_sets.load_examples, method.label",
  r"decode_answers\b": "rj.decode(model, prompts, validation.eval_method(config))",
  r"eval_knobs\b": "dataclasses.asdict(decoding.methods.config_method(kind, config.eval))",
  r"EVAL_KNOBS\b": "decoding.methods.config_method",
  # The call forms: a method name or loose method fields for the Sampler, a name and knobs for eval's runner,
  # and 0.2's aot mesh spelling.
  r"Sampler\([^()]*\bmethod=[\"']": "Sampler(model, tok, rj.AR(...))",
  rf"Sampler\([^()]*\b(?:{_METHOD_FIELDS})=": "Sampler(model, tok, rj.ReFusion(gen_length=...))",
  r"run\([^()]*\bknobs=": "evaluation.runner.run(..., method=rj.ReFusion(...))",
  r"(?:data|fsdp|tensor)=-?\d+,(?:data|fsdp|tensor)=": "the mesh syntax: axis:size joined by + (data:2+tensor:4)",
  r"--decode_mesh[= ][\"']?(?:data|fsdp|tensor)=": "the mesh syntax: axis:size joined by + (data:2+tensor:4)",
}


def test_nothing_shipped_uses_a_name_or_spelling_that_0_3_removed():
  files = [README, *(path for folder in ("docs", "results", "refusion_jax") for path in (ROOT / folder).rglob("*"))]
  found = []
  for path in sorted(p for p in files if p.suffix in (".md", ".py", ".ipynb", ".json", ".jsonl", ".sh")):
    text = path.read_text(encoding="utf-8")
    for pattern, replacement in REMOVED_IN_0_3.items():
      for match in re.finditer(pattern, text):
        before = text[match.start() - 1 : match.start()]
        if before.isalnum() or before == "_":
          continue  # inside a longer name
        line = text.count("\n", 0, match.start()) + 1
        found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r} was removed in 0.3; use {replacement}")
  assert not found, "\n".join(found)


# What 0.3 renamed (the old spelling warns until 0.4; CHANGELOG.md): the docs, results and README show only the new.
RENAMED_IN_0_3 = {
  r"(?:decode|Sampler|Engine)\([^()\n]*\bbatch_size=": "rows= (rj.DecodeOptions)",
  r"refusion_jax\.(?:sample|eval|serve)\b[^\n]*--batch_size\b": "--rows",
  r"refusion_jax\.bench (?:decode|throughput|lora|quant)\b[^\n]*--(?:sizes|size|preset)\b": "--random_init",
  r"refusion_jax\.bench (?:decode|throughput|quant)\b[^\n]*--seed\b": "--init_seed",
}


def test_the_docs_show_only_what_0_3_renamed_things_to():
  files = [README, *(path for folder in ("docs", "results") for path in (ROOT / folder).rglob("*"))]
  found = []
  for path in sorted(p for p in files if p.suffix in (".md", ".ipynb", ".sh")):
    text = path.read_text(encoding="utf-8")
    for pattern, replacement in RENAMED_IN_0_3.items():
      for match in re.finditer(pattern, text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r} was renamed in 0.3; use {replacement}")
  assert not found, "\n".join(found)


def test_the_changelog_opens_with_this_release():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert re.findall(r"^## (\S+)", changelog, re.M)[0] == rj.__version__


def test_the_readme_is_short_and_opens_with_the_two_set_up_commands():
  text = README.read_text()
  assert len(text.splitlines()) <= 200, "the README is read in five minutes: move reference material to docs/"
  commands = re.findall(r"^    (pip install .*)$", text, re.M)
  assert commands[:2] == [
    "pip install -e . && python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo",
    'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile',
  ]
  assert text.index(commands[0]) < text.index("## What this is")
  # CI runs the README's test command as written: it reads it from the README and runs what it read.
  ci = (ROOT / ".ci" / "run").read_text()
  (read,) = re.findall(r"^(readme_tests=.*)$", ci, re.M)
  out = subprocess.run(["bash", "-c", f'{read}; echo "$readme_tests"'], capture_output=True, text=True, cwd=ROOT)
  assert out.stdout.strip() == commands[1] and 'bash -c "$readme_tests"' in ci, out


def test_every_link_in_the_docs_resolves_and_the_readme_links_every_page():
  pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
  broken = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      path = target.split("#")[0]
      if path and "://" not in path and not (page.parent / path).exists():
        broken.append(f"{page.relative_to(ROOT)} -> {target}")
  assert not broken, broken
  linked = set(re.findall(r"\]\(docs/(\w+)\.md\)", README.read_text()))
  assert set(DOCS_PAGES) <= linked, f"the README links no docs/{sorted(set(DOCS_PAGES) - linked)}.md"


def test_the_readme_says_when_deprecated_names_go():
  assert f"removed in {REMOVED_IN}" in README.read_text()


def test_architecture_quotes_the_decoder_contract_as_the_code_defines_it():
  from refusion_jax.decoding import contract

  defined = ast.parse(inspect.getsource(contract.Method)).body[0]
  defined.body = [node for node in defined.body if not isinstance(node, ast.Expr)]  # the docstring
  doc = (ROOT / "docs" / "architecture.md").read_text()
  section = doc[doc.index("## 4.") : doc.index("## 5.")]
  quoted = section[section.index("```python\n") + len("```python\n") :].split("```")[0]
  assert ast.dump(ast.parse(quoted).body[0]) == ast.dump(defined), "docs/architecture.md §4 misquotes contract.Method"


def test_the_glossary_names_only_what_the_code_defines():
  """docs/architecture.md's "Words, one sense each": every name it cites in backticks is defined in the package
  (a class, function, field or file), so the glossary cannot drift from the code it describes."""
  doc = (ROOT / "docs" / "architecture.md").read_text()
  table = doc[doc.index("### Words, one sense each") :].split("\n\n")[2]
  source = "\n".join(path.read_text() for path in (ROOT / "refusion_jax").rglob("*.py"))
  missing = []
  for cited in re.findall(r"`([^`]+)`", table):
    if "/" in cited:
      if not (ROOT / "refusion_jax" / cited).exists():
        missing.append(cited)
      continue
    name = re.sub(r"\(.*", "", cited).split(".")[-1]
    if not re.fullmatch(r"\w+", name):
      continue  # a quoted value, e.g. "refusion"
    if not re.search(rf"(?m)^\s*(?:def |class )?{re.escape(name)}\b\s*[(:=]", source):
      missing.append(cited)
  assert not missing, f"the glossary names what the package does not define: {missing}"
