"""Orbax checkpoints of a training run, and rebuilding a model from one.

A checkpoint directory holds one sub-directory per saved step, each with four items:

| item     | format                 | content                                                 |
| -------- | ---------------------- | ------------------------------------------------------- |
| `params` | arrays (`StandardSave`)| the model's `nnx.State`                                 |
| `train`  | arrays (`StandardSave`)| everything else that moves through the step (optimizer state, step, RNG) |
| `data`   | JSON, one file per process | each process's input-iterator state, so a resumed run sees the same batches |
| `meta`   | JSON                   | `ModelConfig` and tokenizer, so a sampler can rebuild the model alone |

Saves are asynchronous (the arrays are copied off the devices before `save`
returns; files are written in the background) and only fully written steps are
ever listed, so a run killed mid-save resumes from the previous step. Restores
go into an abstract target that carries the *current* shardings, after the
stored shapes have been checked against it.

To rebuild a model alone (sampling, `init_from`, conversion), `refusion_source`
opens a step's `params` and `meta` for the loading front door
(`refusion_jax.checkpoints.load.load_model`); `save_model` writes just those two items.

What can go wrong has a type: a step that cannot be read (truncated, corrupt)
is a `CheckpointDamagedError` and can be moved aside (`move_aside`) so that an
earlier step is used; a step written for another model is a
`CheckpointMismatchError`; a save that fails (disk full, a broken mount) is a
`CheckpointSaveError` that names the last complete step, which a failed save
never touches (old steps are deleted only after a new one is complete).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints import orbax_tree
from refusion_jax.checkpoints.mapping import Rule, Table
from refusion_jax.checkpoints.restore import Source, dotted
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import abstract_model

PARAMS, TRAIN, DATA, META = "params", "train", "data", "meta"
# Name of the checkpoint directory inside a workdir.
CHECKPOINT_SUBDIR = "checkpoints"
# Where a run keeps its own tokenizer (one extended with a mask token, or one copied along by a conversion),
# inside the checkpoint directory; the meta item then names it relatively.
TOKENIZER_SUBDIR = "tokenizer"


@dataclasses.dataclass
class Restored:
  """One restored step: `params` and `train` pytrees shaped as the targets, and `meta`."""

  step: int
  params: Any
  train: Any
  meta: dict


class _IteratorSnapshot:
  """An iterator's state frozen at `save` time.

  grain's checkpoint handler calls `get_state()` when it writes, which an
  asynchronous save may do after the loop has already consumed more batches.
  """

  def __init__(self, iterator: grain.DatasetIterator):
    self._state = json.dumps(iterator.get_state()).encode()

  def get_state(self) -> bytes:
    return self._state


class CheckpointDamagedError(ValueError):
  """A saved step cannot be read (truncated or corrupt files)."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class CheckpointSaveError(RuntimeError):
  """Writing a step failed; the steps saved before it are intact."""


def quiet_checkpoint_noise() -> None:
  """Keep the checkpoint libraries' noise about failures we report ourselves out of a program's output.

  Process-wide, so the entry points call it (`refusion_jax.cli`), not the library:
  - after a failed read, tensorstore completes its futures into orbax's already
    closed asyncio loop, and Python reports each as an unraisable "Event loop is
    closed" exception: those are dropped, every other one passes on;
  - orbax logs each failed background write with its traceback, which
    `CheckpointSaveError` already reports: the traceback is dropped from the record.
  """
  previous = sys.unraisablehook
  if not getattr(previous, "drops_closed_event_loop_noise", False):

    def hook(unraisable: Any) -> None:
      if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
        return
      previous(unraisable)

    hook.drops_closed_event_loop_noise = True
    sys.unraisablehook = hook
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _NoOrbaxTracebacks) for f in absl_logger.filters):
    absl_logger.addFilter(_NoOrbaxTracebacks())


class _NoOrbaxTracebacks(logging.Filter):
  """Drops the traceback of a record orbax logs (the failure itself is reported by our error)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
      record.exc_info = record.exc_text = None
    return True


class Checkpoints:
  """Keep-N, asynchronous checkpoints of (params, train state, data state, metadata)."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = local_path(directory)
    self._saving: int | None = None  # the step whose save may still be in flight
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      enable_async_checkpointing=async_save,
      create=True,
      cleanup_tmp_directories=True,  # the partial files of a save that failed or was killed
    )
    # Explicit handlers, so that a fresh manager can read item metadata before any restore.
    handlers = {
      PARAMS: ocp.StandardCheckpointHandler(),
      TRAIN: ocp.StandardCheckpointHandler(),
      DATA: grain.checkpoint.CheckpointHandler(),
      META: ocp.JsonCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, *, params: Any, train: Any, data_iterator: grain.DatasetIterator, meta: dict) -> None:
    """Start saving `step` (returns once the arrays are off the devices).

    Raises:
      CheckpointSaveError: this save, or the previous one still in flight, failed.
    """
    args = ocp.args.Composite(
      **{
        PARAMS: ocp.args.StandardSave(params),
        TRAIN: ocp.args.StandardSave(train),
        DATA: grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator)),
        META: ocp.args.JsonSave(meta),
      }
    )
    self._start(step, args)

  def _start(self, step: int, args: ocp.args.Composite) -> None:
    self.wait()  # a failure of the previous save is reported as that step's
    self._saving = step
    self._guarded(lambda: self._manager.save(step, args=args, force=True))

  def _guarded(self, write: Callable[[], Any]) -> None:
    """Run `write`, turning a failure of the save in flight into a `CheckpointSaveError`."""
    try:
      write()
    except Exception as error:  # orbax and tensorstore raise many types for a failed write
      failed, self._saving = self._saving, None
      self._manager.reload()  # forget the failed step: only complete ones are on disk
      raise CheckpointSaveError(
        f"Saving checkpoint step {failed} to {self.directory} failed ({type(error).__name__}: {error}). "
        f"The last complete checkpoint, step {self.latest_step()}, is intact and the run stopped. "
        "Free disk space or repair the directory, then rerun the same command to resume from it."
      ) from error

  def save_model(self, step: int, *, params: Any, meta: dict) -> None:
    """Save only the parameters and the meta item: a model to sample from or to start a run with, not to resume.

    Raises:
      CheckpointSaveError: this save, or the previous one still in flight, failed.
    """
    self._start(step, ocp.args.Composite(**{PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta)}))

  def restore(
    self,
    step: int,
    *,
    abstract_params: Any,
    abstract_train: Any | None = None,
    data_iterator: grain.DatasetIterator | None = None,
  ) -> Restored:
    """Restore `step` into abstract targets (`jax.ShapeDtypeStruct` leaves with shardings).

    With `abstract_train=None` only the parameters (and metadata) are read; a
    given `data_iterator` is moved, in place, to the saved position.

    Raises:
      ValueError: the step is missing or unreadable (truncated, corrupt), or a
        stored array's shape or structure does not fit the target.
    """
    if step not in self.all_steps():
      raise ValueError(f"No checkpoint for step {step} in {self.directory}; saved steps: {self.all_steps()}.")
    targets = {PARAMS: abstract_params} if abstract_train is None else {PARAMS: abstract_params, TRAIN: abstract_train}
    try:
      stored = self._manager.item_metadata(step)
      for name, target in targets.items():
        _check_shapes(name, stored[name], target, os.path.join(self.directory, str(step)))
      args = {name: ocp.args.StandardRestore(target) for name, target in targets.items()}
      args[META] = ocp.args.JsonRestore()
      if data_iterator is not None:
        args[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
      out = self._manager.restore(step, args=ocp.args.Composite(**args))
    except CheckpointMismatchError:
      raise
    except Exception as error:  # orbax / tensorstore raise many types for unreadable files
      raise self._damaged(step, error) from error
    return Restored(step=step, params=out[PARAMS], train=out.get(TRAIN), meta=out[META])

  def _damaged(self, step: int, error: Exception) -> CheckpointDamagedError:
    return CheckpointDamagedError(
      f"Checkpoint step {step} in {self.directory} could not be read; it may be truncated or "
      f"corrupt ({type(error).__name__}: {error}).",
      step,
    )

  def read_meta(self, step: int) -> dict:
    """The `meta` item of `step`.

    Raises:
      CheckpointDamagedError: it cannot be read.
    """
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as error:  # a missing or garbled JSON file, from orbax's handlers
      raise self._damaged(step, error) from error

  def move_aside(self, step: int, destination: str) -> str:
    """Move the directory of `step` into `destination` (created), out of the manager's sight; returns its new path.

    Process 0 moves it, every process then sees the remaining steps.
    """
    target = os.path.join(destination, str(step))
    if jax.process_index() == 0:
      suffix = 1
      while os.path.exists(target):  # the same step damaged again in a later run
        target = os.path.join(destination, f"{step}.{suffix}")
        suffix += 1
      os.makedirs(destination, exist_ok=True)
      os.rename(os.path.join(self.directory, str(step)), target)
    multihost_utils.sync_global_devices(f"refusion_jax: checkpoint {step} moved aside")
    self._manager.reload()
    return target

  def reached_preemption(self, step: int) -> bool:
    """Whether JAX's preemption notice (multi-host TPU) asks to save at `step`."""
    return self._manager.reached_preemption(step)

  def check(self) -> None:
    """Report a save that failed in the background, without waiting for the one in flight.

    Raises:
      CheckpointSaveError: a background save failed.
    """
    if not self._manager.is_saving_in_progress():  # then waiting costs nothing, and reports how it ended
      self.wait()

  def wait(self) -> None:
    """Block until every started save is on disk.

    Raises:
      CheckpointSaveError: a save in flight failed.
    """
    self._guarded(self._manager.wait_until_finished)
    self._saving = None

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class CheckpointMismatchError(ValueError):
  """A stored array does not fit the model/optimizer the config describes."""


def _path_name(path) -> str:
  keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return ".".join(k for k in keys if k != "value")


def _check_shapes(item: str, stored: Any, target: Any, where: str) -> None:
  stored_shapes = {_path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
  target_shapes = {_path_name(p): tuple(t.shape) for p, t in jax.tree_util.tree_flatten_with_path(target)[0]}
  for name, shape in target_shapes.items():
    if name not in stored_shapes:
      raise CheckpointMismatchError(
        f"Checkpoint {where} ({item}) has no array {name!r} that the current config needs; "
        "the checkpoint was written for a different model or optimizer config."
      )
    if stored_shapes[name] != shape:
      raise CheckpointMismatchError(
        f"Checkpoint {where} ({item}) stores {name!r} with shape {stored_shapes[name]}, but the current "
        f"config needs {shape}. Use the model config the checkpoint was trained with (see its meta item)."
      )
  extra = sorted(set(stored_shapes) - set(target_shapes))
  if extra:
    raise CheckpointMismatchError(
      f"Checkpoint {where} ({item}) has arrays the current config lacks, e.g. {extra[0]!r}; "
      "the checkpoint was written for a different model or optimizer config."
    )


def model_meta(model_config: ModelConfig, tokenizer: str, **extra) -> dict:
  """The `meta` item: enough to rebuild the model and its tokenizer."""
  return dict(model_config=dataclasses.asdict(model_config), tokenizer=tokenizer, **extra)


def local_path(path: str | os.PathLike) -> str:
  """`path` made absolute; a URL is refused rather than taken for a relative path.

  `os.path.abspath("gs://b/run")` is `./gs:/b/run`: checkpoints would land on the
  host's disk and vanish with it at preemption.
  """
  path = os.fspath(path)
  if "://" in path:
    raise ValueError(
      f"{path!r} is a URL, but refusion_jax reads and writes workdirs through the file system. "
      "Mount the bucket (e.g. `gcsfuse --implicit-dirs BUCKET /mnt/BUCKET`) and pass the mounted path."
    )
  return os.path.abspath(path)


def checkpoint_dir(path: str) -> str:
  """A workdir or a checkpoint directory -> the checkpoint directory."""
  path = local_path(path)
  inner = os.path.join(path, CHECKPOINT_SUBDIR)
  return inner if os.path.isdir(inner) else path


def run_step(path: str, step: int | None = None) -> tuple[str, int, dict]:
  """(checkpoint directory, step, meta) of a workdir or checkpoint directory; `step` defaults to the latest."""
  directory = checkpoint_dir(path)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No checkpoint directory at {path!r}; pass the --workdir of a training run.")
  with Checkpoints(directory, async_save=False) as checkpoints:
    steps = checkpoints.all_steps()
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{directory} holds no complete checkpoint.")
    if step not in steps:
      raise ValueError(f"No checkpoint for step {step} in {directory}; saved steps: {steps}.")
    return directory, step, checkpoints.read_meta(step)


def table(model_config: ModelConfig) -> Table:
  """Our own names: each parameter stored under its path (+ ".value"), its axes its logical axes."""
  _, state = abstract_model(model_config)
  rules = {}
  for path, variable in nnx.to_flat_state(state):
    ours = re.sub(r"^layers\.\d+\.", "layers.{layer}.", dotted(path))
    rules.setdefault(ours, Rule(ours + ".value", ours, tuple(variable.get_metadata()["out_sharding"])))
  return Table(rules.values())


def refusion_source(path: str, step: int | None = None) -> tuple[Source, str | None]:
  """The parameters of a training run's step (default: the latest) and its tokenizer (a name, or a path
  resolved against the checkpoint directory; None when the run recorded none)."""
  directory, step, meta = run_step(path, step)
  model_config = ModelConfig(**meta["model_config"])
  item = os.path.join(directory, str(step), PARAMS)
  source = Source(
    format="refusion",
    location=f"refusion training checkpoint, step {step} in {directory}",
    arrays=orbax_tree.item_arrays(item),
    table=table(model_config),
    fetch=orbax_tree.fetcher(item),
    config=model_config,
  )
  tokenizer = meta.get("tokenizer")
  local = os.path.join(directory, tokenizer or "")
  return source, (local if tokenizer and os.path.isdir(local) else tokenizer)
