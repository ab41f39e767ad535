"""The built-in dataset: short verifiable tasks generated locally, no download.

Every answer is a function of its query, so each task is a query generator plus
a solver, and checking a model's response means solving the query again. The
tasks are picked so that slot-parallel decoding matters (many answer pieces are
independent of each other: copy, reverse, sort, lookup) while a tiny model can
learn them on a CPU in minutes: with the byte tokenizer every example, query +
response + EOS, fits in `BYTE_SEQ_LEN` = 64 tokens.

| task      | query                       | response                                 |
| --------- | --------------------------- | ---------------------------------------- |
| copy      | `copy: qhxbe`               | `qhxbe`                                  |
| reverse   | `reverse: qhxbe`            | `ebxhq`                                  |
| sort      | `sort: 7 2 9 2`             | `2 2 7 9`                                |
| add       | `add: 4821+937`             | `5758`                                   |
| add_steps | `add steps: 4821+937`       | `1+7=8 2+3=5 8+9=17 4+0+1=5 so 5758`     |
| lookup    | `find k: b=7 k=12 c=305`    | `12`                                     |
| code      | `code n: add 12; mul 4`     | `def add12_mul4(n): return (n + 12) * 4` |

Splits are disjoint by construction: a query's split is a hash of its text
(`split_of`), and each split is drawn only from its own queries.
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from collections.abc import Callable, Mapping, Sequence

BYTE_SEQ_LEN = 64
SPLITS = ("train", "validation", "test")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Share of the query space per split, in twentieths: 90% / 5% / 5%.
_SPLIT_OF_BUCKET = ("validation", "test") + ("train",) * 18
# Draws allowed per requested example before a task is declared exhausted (a
# split can ask for more distinct queries than a task has).
_MAX_DRAWS_PER_EXAMPLE = 2_000


def _word(rng: random.Random, low: int, high: int) -> str:
  return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(low, high)))


def _number(rng: random.Random, max_digits: int) -> int:
  return rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)


def _parse(pattern: str, query: str, task: str) -> re.Match:
  match = re.fullmatch(pattern, query)
  if match is None:
    raise ValueError(f"{query!r} is not a {task!r} query (expected the form {pattern!r}).")
  return match


# copy / reverse -------------------------------------------------------------


def _copy_query(rng: random.Random) -> str:
  return f"copy: {_word(rng, 4, 16)}"


def _copy_solve(query: str) -> str:
  return _parse(r"copy: ([a-z]+)", query, "copy")[1]


def _reverse_query(rng: random.Random) -> str:
  return f"reverse: {_word(rng, 4, 16)}"


def _reverse_solve(query: str) -> str:
  return _parse(r"reverse: ([a-z]+)", query, "reverse")[1][::-1]


# sort -----------------------------------------------------------------------


def _sort_query(rng: random.Random) -> str:
  alphabet = rng.choice(("0123456789", _LETTERS))
  return "sort: " + " ".join(rng.choice(alphabet) for _ in range(rng.randint(4, 10)))


def _sort_solve(query: str) -> str:
  items = _parse(r"sort: ([0-9a-z]( [0-9a-z])*)", query, "sort")[1].split()
  return " ".join(sorted(items))


# addition, plain and with worked column steps -------------------------------


def _add_query(rng: random.Random) -> str:
  return f"add: {_number(rng, 5)}+{_number(rng, 5)}"


def _add_solve(query: str) -> str:
  match = _parse(r"add: (\d+)\+(\d+)", query, "add")
  return str(int(match[1]) + int(match[2]))


def _add_steps_query(rng: random.Random) -> str:
  return f"add steps: {_number(rng, 4)}+{_number(rng, 4)}"


def _add_steps_solve(query: str) -> str:
  """Schoolbook columns, least significant first: `x+y[+1]=s`, then `so <sum>`."""
  match = _parse(r"add steps: (\d+)\+(\d+)", query, "add_steps")
  a, b = match[1], match[2]
  width = max(len(a), len(b))
  a, b = a.zfill(width), b.zfill(width)
  steps, carry = [], 0
  for x, y in zip(reversed(a), reversed(b)):
    total = int(x) + int(y) + carry
    steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
    carry = total // 10
  return " ".join(steps) + f" so {int(a) + int(b)}"


def _add_steps_answer(response: str) -> str:
  """Only the final sum is graded: the steps are the model's working."""
  return response.rsplit(" so ", 1)[-1]


# key-value lookup -----------------------------------------------------------


def _lookup_query(rng: random.Random) -> str:
  keys = rng.sample(_LETTERS, rng.randint(3, 6))
  pairs = " ".join(f"{key}={_number(rng, 3)}" for key in keys)
  return f"find {rng.choice(keys)}: {pairs}"


def _lookup_solve(query: str) -> str:
  match = _parse(r"find ([a-z]): ((?:[a-z]=\d+ ?)+)", query, "lookup")
  table = dict(pair.split("=") for pair in match[2].split())
  if match[1] not in table:
    raise ValueError(f"{query!r}: key {match[1]!r} is not in the table.")
  return table[match[1]]


# templated code -------------------------------------------------------------

_OPERATORS = {"add": "+", "sub": "-", "mul": "*"}


def _code_query(rng: random.Random) -> str:
  ops = [f"{rng.choice(list(_OPERATORS))} {rng.randint(1, 20)}" for _ in range(rng.randint(1, 2))]
  return f"code {rng.choice('xnv')}: {'; '.join(ops)}"


def _code_solve(query: str) -> str:
  match = _parse(r"code ([a-z]): (add|sub|mul) (\d+)(?:; (add|sub|mul) (\d+))?", query, "code")
  var, first_op, first_arg, second_op, second_arg = match.groups()
  body = f"{var} {_OPERATORS[first_op]} {first_arg}"
  name = f"{first_op}{first_arg}"
  if second_op:
    if second_op == "mul" and first_op != "mul":
      body = f"({body})"
    body = f"{body} {_OPERATORS[second_op]} {second_arg}"
    name = f"{name}_{second_op}{second_arg}"
  return f"def {name}({var}): return {body}"


# registry -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Task:
  make_query: Callable[[random.Random], str]
  solve: Callable[[str], str]
  # The part of a response that is graded (default: all of it).
  graded: Callable[[str], str] = lambda response: response


_TASKS = {
  "copy": _Task(_copy_query, _copy_solve),
  "reverse": _Task(_reverse_query, _reverse_solve),
  "sort": _Task(_sort_query, _sort_solve),
  "add": _Task(_add_query, _add_solve),
  "add_steps": _Task(_add_steps_query, _add_steps_solve, _add_steps_answer),
  "lookup": _Task(_lookup_query, _lookup_solve),
  "code": _Task(_code_query, _code_solve),
}
TASKS: tuple[str, ...] = tuple(_TASKS)


def _task(name: str) -> _Task:
  if name not in _TASKS:
    raise ValueError(f"Unknown task {name!r}; the built-in tasks are {TASKS}.")
  return _TASKS[name]


def split_of(query: str) -> str:
  """The split ("train", "validation" or "test") a query belongs to, from a hash of its text."""
  return _SPLIT_OF_BUCKET[zlib.crc32(query.encode("utf-8")) % len(_SPLIT_OF_BUCKET)]


def solve(task: str, query: str) -> str:
  """The reference response to `query`; ValueError if it is not a query of `task`."""
  return _task(task).solve(query)


def graded_part(task: str) -> Callable[[str], str]:
  """The part of a response to `task` that is graded (all of it, but for "add_steps": the final sum)."""
  return _task(task).graded


def _normalize(text: str) -> str:
  return " ".join(text.split())


def check_answer(task: str, query: str, response: str) -> bool:
  """Whether `response` answers `query` exactly, up to runs of whitespace.

  For "add_steps" only the final sum (after the last " so ") is graded.
  """
  spec = _task(task)
  return spec.graded(_normalize(response)) == spec.graded(_normalize(spec.solve(query)))


def is_correct(example: Mapping[str, str], answer: str) -> bool:
  """Whether `answer` is right for a {query, response[, task]} record: built-in tasks are checked by re-solving
  the query (`check_answer`), other records by exact match with the response up to runs of whitespace."""
  if example.get("task"):
    try:
      return check_answer(example["task"], example["query"], answer)
    except ValueError:  # a task the checker does not know (user data tagged with a task name)
      pass
  return _normalize(answer) == _normalize(example["response"])


def generate_examples(
  split: str, num_examples: int, *, seed: int = 0, tasks: Sequence[str] = TASKS
) -> list[dict[str, str]]:
  """`num_examples` distinct examples of `split`, tasks in round-robin order.

  Deterministic in (split, num_examples, seed, tasks): each split draws from its
  own random stream, so asking for more validation examples does not change the
  training set. Returns [{"query", "response", "task"}].
  """
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  specs = [(name, _task(name)) for name in tasks]
  if not specs:
    raise ValueError("`tasks` is empty; pass at least one of " + ", ".join(TASKS) + ".")
  rng = random.Random(f"refusion-tasks:{seed}:{split}")
  seen: set[str] = set()
  examples = []
  for index in range(num_examples):
    name, spec = specs[index % len(specs)]
    for _ in range(_MAX_DRAWS_PER_EXAMPLE):
      query = spec.make_query(rng)
      if query not in seen and split_of(query) == split:
        break
    else:
      # Round robin: this task made every len(specs)-th example so far.
      raise ValueError(
        f"Task {name!r} ran out of distinct {split} queries after {index // len(specs)} of its examples"
        f" ({index} over all {len(specs)} tasks); ask for fewer examples or add tasks."
      )
    seen.add(query)
    examples.append({"query": query, "response": spec.solve(query), "task": name})
  return examples
