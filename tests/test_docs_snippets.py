"""The README and docs run as written, from a folder outside the repository.

Every ```` ```python ```` block of README.md and docs/*.md is executed, a page's blocks in order in one namespace,
as a reader pastes them into a notebook; the demo's workdir (`DEMO`) is replaced by a tiny random run made here.
Every `python -m refusion_jax...` command of the pages' code blocks names only flags its command has (its `--help`
lists them); in a block marked `<!-- docs-test: run -->`, the commands that take the demo's workdir run, on the tiny
run. A block marked `<!-- docs-test: skip REASON -->` (it needs the network, downloaded checkpoints or a running
server) is skipped, by name and reason. The mark is the line just above the block (tests/README.md).
"""

import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from helpers.train_utils import REPO, load_config

from refusion_jax.checkpoints import export
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.training import config_file
from refusion_jax.training.loop import train_and_evaluate

ROOT = pathlib.Path(REPO)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The workdir the README's first command trains; the snippets run on a tiny random run in its place.
DEMO = "/tmp/refusion_demo"
_MARK = re.compile(r"<!-- docs-test: (run|skip)\b\s*(.*?)\s*-->")


@dataclasses.dataclass(frozen=True)
class Block:
  """A code block of a page: `kind` "python" (a ```python fence) or "shell" (any other code block).

  mark: "run", "skip" or "" (from a `<!-- docs-test: ... -->` line just above it); detail: what follows the mark
  (why it is skipped).
  """

  page: str
  line: int
  kind: str
  text: str
  mark: str = ""
  detail: str = ""

  @property
  def name(self) -> str:
    return f"{self.page}:{self.line}"


def code_blocks(path: pathlib.Path) -> list[Block]:
  """The fenced and the indented code blocks of a Markdown page, with their marks."""
  lines = path.read_text().splitlines()
  page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
  blocks, i = [], 0
  while i < len(lines):
    fence = re.match(r"^```(\w*)", lines[i])
    indented = lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip())
    if not (fence or indented):
      i += 1
      continue
    start = i
    if fence:
      end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
      body, kind, i = lines[i + 1 : end], "python" if fence[1] == "python" else "shell", end + 1
    else:
      while i < len(lines) and (
        lines[i].startswith("    ") or (not lines[i].strip() and i + 1 < len(lines) and lines[i + 1].startswith("    "))
      ):
        i += 1
      body, kind = [line[4:] for line in lines[start:i]], "shell"
    above = next((line for line in reversed(lines[:start]) if line.strip()), "")
    mark = _MARK.fullmatch(above.strip())
    blocks.append(Block(page, start + 1, kind, "\n".join(body), *(mark.groups() if mark else ())))
  return blocks


def commands(block: Block) -> list[list[str]]:
  """The `python -m refusion_jax.X ARGS` commands of a shell block, each as [module, *args]."""
  found = []
  for line in block.text.replace("\\\n", " ").splitlines():
    if "python -m refusion_jax" not in line:
      continue
    tokens = shlex.split(line, comments=True)
    for k, token in enumerate(tokens[:-2]):
      if token == "python" and tokens[k + 1] == "-m" and tokens[k + 2].startswith("refusion_jax"):
        rest = tokens[k + 2 :]
        end = next((j for j, t in enumerate(rest) if t in ("&&", "||", ";", "|")), len(rest))
        found.append(rest[:end])
  return found


def _flags(args: list[str]) -> set[str]:
  """The flags a command line sets: `--name` of `--name=value` and of absl's `--config.field=value`."""
  return {arg.split("=")[0].split(".")[0] for arg in args if arg.startswith("--")}


def _in_process(module: str) -> bool:
  """Whether the command's `main(argv=None)` can run here; absl programs define their flags only as `__main__`."""
  main = importlib.import_module(module).main
  first = next(iter(inspect.signature(main).parameters.values()))
  return first.default is None


def run_command(module: str, args: list[str], cwd: pathlib.Path) -> tuple[int, str]:
  """Run `python -m module args` from `cwd`: (exit status, stdout + stderr)."""
  if not _in_process(module):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
      [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout + done.stderr
  output = io.StringIO()
  previous = os.getcwd()
  os.chdir(cwd)
  try:
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
      try:
        status = importlib.import_module(module).main(args)
      except SystemExit as exit_:  # argparse's or lm-eval's --help
        status = exit_.code
  finally:
    os.chdir(previous)
  return int(status or 0), output.getvalue()


_HELPS: dict[tuple[str, ...], str] = {}


def help_of(module: str, args: list[str], cwd: pathlib.Path) -> str:
  """`--help` of the command (of its subcommand: a first argument that is not a flag), asked once per command."""
  subcommand = args[:1] if args and not args[0].startswith("-") and _in_process(module) else []
  key = (module, *subcommand)
  if key not in _HELPS:
    status, text = run_command(module, [*subcommand, "--help"], cwd)
    # absl programs end their --help with status 1; a command that cannot start shows a traceback.
    assert status in (0, 1) and "Traceback" not in text, f"python -m {' '.join(key)} --help failed:\n{text}"
    _HELPS[key] = text
  return _HELPS[key]


def missing_flags(module: str, args: list[str], help_text: str) -> set[str]:
  """The flags of `args` that the command's `help_text` does not list."""
  return {flag for flag in _flags(args) if not re.search(rf"{re.escape(flag)}\b", help_text)}


def run_python(block: Block, namespace: dict, demo: str) -> None:
  """Execute a Python block in `namespace`, on `demo` in place of the demo's workdir; errors name page and line."""
  source = "\n" * block.line + block.text.replace(DEMO, demo)
  exec(compile(source, block.page, "exec"), namespace)  # noqa: S102 - the docs' own code


# ------------------------------------------------------------------ the pages' blocks

BLOCKS = [block for page in PAGES for block in code_blocks(page)]
PYTHON = [block for block in BLOCKS if block.kind == "python"]
COMMANDS = [(block, command) for block in BLOCKS if block.kind == "shell" for command in commands(block)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
  """A stand-in for the demo's workdir: a random byte-level model and the smoke config, recorded as a run."""
  workdir = tmp_path_factory.mktemp("demo_stand_in")
  tokenizer = ByteTokenizer()
  special = dict(mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
  model = init_model(tiny(vocab_size=tokenizer.vocab_size, num_layers=1, **special))  # one layer: quick compiles
  export.write_refusion(model, str(workdir), step=1, tokenizer="bytes")
  config_file.write_run_config(load_config("demo"), str(workdir))
  return str(workdir)


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> pathlib.Path:
  """A folder outside the repository to run from."""
  return tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def namespaces() -> dict:
  """Per page: (its namespace, how many of its blocks ran in it)."""
  return {}


@pytest.mark.parametrize("block", PYTHON, ids=lambda block: block.name)
def test_python_block_runs(block, demo, cwd, namespaces, monkeypatch):
  if block.mark == "skip":
    pytest.skip(f"{block.name} is marked: {block.detail}")
  monkeypatch.chdir(cwd)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  namespace, done = namespaces.setdefault(block.page, ({}, 0))
  page_blocks = [b for b in PYTHON if b.page == block.page]
  for earlier in page_blocks[done : page_blocks.index(block)]:  # the page's blocks above it, when run alone
    if earlier.mark != "skip":
      run_python(earlier, namespace, demo)
  run_python(block, namespace, demo)
  namespaces[block.page] = (namespace, page_blocks.index(block) + 1)


# Commands whose module imports an extra beyond [test] (tests/helpers/extras.py): their checks run where it is.
COMMAND_EXTRAS = {"refusion_jax.harness": "eval"}


def _command_params() -> list:
  marks = lambda module: [pytest.mark.extra(COMMAND_EXTRAS[module])] if module in COMMAND_EXTRAS else []  # noqa: E731
  return [pytest.param(b, c, marks=marks(c[0]), id=f"{b.name}:{c[0]}") for b, c in COMMANDS]


@pytest.mark.parametrize(("block", "command"), _command_params())
def test_command_runs_or_names_only_flags_it_has(block, command, demo, cwd):
  module, args = command[0], command[1:]
  if block.mark == "skip":
    pytest.skip(f"{block.name} is marked: {block.detail}")
  if block.mark == "run" and DEMO in args:
    status, output = run_command(module, [arg.replace(DEMO, demo) for arg in args], cwd)
    assert status == 0, f"{block.name}: `python -m {' '.join(command)}` failed from {cwd}:\n{output}"
    return
  missing = missing_flags(module, args, help_of(module, args, cwd))
  assert not missing, f"{block.name}: `python -m {module}` has no {sorted(missing)}"


def test_marks_say_what_they_mean():
  for page in PAGES:
    lines = page.read_text().splitlines()
    for number, line in enumerate(lines, 1):
      if "docs-test" in line:
        assert _MARK.fullmatch(line.strip()), f"{page.name}:{number}: write <!-- docs-test: run --> or skip REASON"
        below = next(other for other in lines[number:] if other.strip())
        assert below.startswith(("```", "    ")), f"{page.name}:{number}: a mark goes on the line above a code block"
  for block in BLOCKS:
    runs = [command for command in commands(block) if DEMO in command]
    assert block.mark != "run" or runs, f"{block.name} is marked to run, but no command of it takes {DEMO}"
    assert block.mark != "skip" or block.detail, f"{block.name} is skipped without saying why"


# ------------------------------------------------------------------ the checks catch drift


def test_a_broken_snippet_fails(tmp_path, demo):
  readme = [block for block in PYTHON if block.page == "README.md"][0]
  broken = dataclasses.replace(readme, text=readme.text.replace("slot_threshold=", "plan_threshold="))
  assert broken.text != readme.text
  with pytest.raises(TypeError, match="plan_threshold"):
    run_python(broken, {}, demo)
  page = tmp_path / "page.md"
  page.write_text("Text.\n\n    python -m refusion_jax.eval --checkpoint DIR --subset test   # a renamed flag\n")
  ((block, (module, *args)),) = [(b, c) for b in code_blocks(page) for c in commands(b)]
  assert missing_flags(module, args, help_of(module, args, tmp_path)) == {"--subset"}


# ------------------------------------------------------------------ on the demo itself


@pytest.mark.slow
def test_the_readmes_examples_answer_on_the_demo(tmp_path_factory, monkeypatch):
  """The README's decoding examples, run on the demo its first command trains, give non-empty answers.

  REFUSION_DEMO_WORKDIR names a trained demo workdir to use; without it the demo is trained here (about 5 minutes
  on a 2-core CPU).
  """
  workdir = os.environ.get("REFUSION_DEMO_WORKDIR")
  if not workdir:
    workdir = str(tmp_path_factory.mktemp("demo"))
    train_and_evaluate(config_file.load_config(ROOT / "configs" / "demo.py"), workdir)
  monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
  namespace = {}
  for block in PYTHON:
    if block.page == "README.md" and block.mark != "skip":
      run_python(block, namespace, workdir)
  sampler, tokenizer, result = namespace["sampler"], namespace["tokenizer"], namespace["result"]
  assert sampler("code n: add 11; mul 16").strip(), "the README's Sampler example answers nothing on the demo"
  assert tokenizer.decode(result.tokens[0]).strip(), "the README's ids-in example answers nothing on the demo"
