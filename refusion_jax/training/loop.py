"""Training and evaluation of ReFusion (and the AR / MDM baselines) on one backbone.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo
    python -m refusion_jax.train --config configs/demo.py --workdir DIR --config.num_train_steps=200

`train_and_evaluate(config, workdir)` does everything; `refusion_jax.train` only parses flags.
The loop:

1. Build (once) and open the data: the built-in tasks or query/response JSON.
2. Build the train state where it lives: parameters and optimizer state are
   created by a jitted init whose outputs carry the mesh shardings.
   Precedence: resume from `workdir/checkpoints`, else `init_from_hf` (or an
   `init_from` that is a Hugging Face directory), else `init_from` (a run of
   ours, a tunix or MaxText checkpoint; `init_format` says which, default
   detect), else `init_from_checkpoint` (parameters of another run), else a
   fresh init.
3. Step: one jitted function `state, batch -> state, metrics` with in/out
   shardings; gradient accumulation is a `lax.scan` over microbatches inside
   it (one optimizer update per step, so the step count, schedule and
   checkpoints are in optimizer updates).
4. Every step the loss and gradient norm are checked on the host: a
   non-finite value stops the run before anything is saved for that step.
   SIGTERM (preemption) sets a flag; the loop saves and returns cleanly.
5. Periodically: TensorBoard / console metrics, validation loss, exact match
   and tokens-per-forward of decoding (ReFusion's `decode.generate`, or the
   baselines' decoders), and checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints.orbax import (
  CHECKPOINT_SUBDIR,
  Checkpoints,
  abstract_model,
  load_model_from_checkpoint,
  local_path,
  model_meta,
)
from refusion_jax.data import pipeline
from refusion_jax.data.tasks import check_answer
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model.config import ModelConfig, preset
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel import sharding
from refusion_jax.training.metrics import MetricsLogger, console
from refusion_jax.training.objective import ObjectiveConfig, loss_fn


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN/Inf; the run stopped without saving that step."""


@flax.struct.dataclass
class TrainState:
  """Everything that moves through the jitted step.

  step:      [] int32, optimizer updates applied so far.
  params:    the model's `nnx.State` (`nnx.Param` leaves with logical axes).
  opt_state: the optax state (its moments mirror `params`, axes included).
  rng:       [2] uint32 base key; step k draws from fold_in(rng, k), so a resumed
             run draws exactly what an uninterrupted one would.
  """

  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  rng: jax.Array

  def train_part(self) -> dict:
    """What the `train` checkpoint item holds (all but the parameters)."""
    return dict(step=self.step, opt_state=self.opt_state, rng=self.rng)


@dataclasses.dataclass
class TrainResult:
  """What a call to `train_and_evaluate` did.

  losses: training loss of each step run in this call.
  evals: (step, validation metrics) of each evaluation.
  samples: the last evaluation's decoded examples (query, answer, correct).
  stopped_by: "finished", "preempted" or "stop_after_step".
  """

  step: int
  losses: dict[int, float]
  evals: list[tuple[int, dict[str, float]]]
  samples: list[dict[str, Any]]
  stopped_by: str


# ----------------------------------------------------------------- configuration


def model_config_from(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
  """`config.model.preset` with every other `config.model` field as an override.

  Special token ids the config leaves unset come from the tokenizer, so that a
  checkpoint's model config is enough to decode.
  """
  fields = dict(config.model)
  model_config = preset(fields.pop("preset"), **fields)
  return _with_tokenizer_ids(model_config, tokenizer)


def _with_tokenizer_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
  ids = dict(mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
  return model_config.replace(**{k: v for k, v in ids.items() if getattr(model_config, k) is None and v is not None})


def objective_config_from(config: ml_collections.ConfigDict, model_config: ModelConfig) -> ObjectiveConfig:
  """The objective of `config.objective`, with the model's mask and pad ids."""
  mask_id = model_config.mask_token_id
  if mask_id is None:
    if config.objective.kind != "ar":
      raise ValueError("The model has no mask token id; set config.model.mask_token_id or use a tokenizer with one.")
    mask_id = 0  # never fed: the AR objective masks nothing
  return ObjectiveConfig(
    kind=config.objective.kind,
    slot_sizes=tuple(config.objective.slot_sizes),
    eps=config.objective.eps,
    mask_id=mask_id,
    pad_id=model_config.pad_token_id,
  )


def make_optimizer(
  opt: ml_collections.ConfigDict, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW after global-norm clipping, with linear warmup then `opt.decay` ("cosine", "linear", "constant").

  Weight decay applies to matrices only (not to norm scales).
  """
  decay_steps = max(total_steps - opt.warmup_steps, 1)
  end_lr = opt.lr * opt.final_lr_ratio
  decays = {
    "cosine": optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.final_lr_ratio),
    "linear": optax.linear_schedule(opt.lr, end_lr, decay_steps),
    "constant": optax.constant_schedule(opt.lr),
  }
  if opt.decay not in decays:
    raise ValueError(f"optimizer.decay={opt.decay!r}; choose one of {sorted(decays)}.")
  warmup = optax.linear_schedule(0.0, opt.lr, opt.warmup_steps)
  schedule = optax.join_schedules([warmup, decays[opt.decay]], [opt.warmup_steps])
  tx = optax.chain(
    optax.clip_by_global_norm(opt.grad_clip),
    optax.adamw(
      schedule,
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    ),
  )
  return tx, schedule


# ------------------------------------------------------------------ the step


def _microbatches(x: jax.Array, count: int) -> jax.Array:
  """[batch, ...] -> [count, batch / count, ...], microbatch i = rows i, i + count, ...

  Strided rather than contiguous so that every device keeps its own rows in
  every microbatch (the batch axis is sharded over devices).
  """
  return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def make_train_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  objective: ObjectiveConfig,
  grad_accum_steps: int,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """The (un-jitted) step: average gradients over `grad_accum_steps` microbatches, one AdamW update.

  Batch: tokens [batch, length], prompt_len [batch], answer_len [batch].
  Metrics: loss, ar_loss, mdm_loss, num_ar_tokens, num_mdm_tokens (microbatch
  means), grad_norm (before clipping), learning_rate (of this update).
  """

  def loss_of(params, batch, key):
    return loss_fn(nnx.merge(graphdef, params), batch, key, objective)

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    key = jax.random.fold_in(state.rng, state.step)
    micro = jax.tree.map(lambda x: _microbatches(x, grad_accum_steps), batch)

    def accumulate(carry, inputs):
      index, microbatch = inputs
      (_, metrics), grads = grad_fn(state.params, microbatch, jax.random.fold_in(key, index))
      return jax.tree.map(jnp.add, carry, (grads, metrics)), None

    (_, metrics_shape), grads_shape = jax.eval_shape(grad_fn, state.params, jax.tree.map(lambda x: x[0], micro), key)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, metrics_shape))
    (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum_steps), micro))
    grads, metrics = jax.tree.map(lambda x: x / grad_accum_steps, (grads, metrics))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return step


def make_eval_step(graphdef: nnx.GraphDef, objective: ObjectiveConfig) -> Callable:
  """(params, batch, key) -> metrics of the training loss, without gradients."""

  def eval_step(params, batch, key):
    return loss_fn(nnx.merge(graphdef, params), batch, key, objective)[1]

  return eval_step


# ------------------------------------------------------------------ state placement


@dataclasses.dataclass
class Placement:
  """The mesh, the shardings of the train state, and the jitted functions that use them."""

  mesh: jax.sharding.Mesh
  rules: tuple
  state_shardings: TrainState
  abstract_state: TrainState  # ShapeDtypeStructs carrying `state_shardings`

  def batch(self, batch: Mapping[str, np.ndarray]) -> dict:
    """This process's rows of a batch -> global arrays sharded over the mesh."""
    return sharding.shard_batch(batch, self.mesh, self.rules)

  def _batch_shardings(self) -> dict:
    return sharding.batch_shardings(_BATCH_EXAMPLE, self.mesh, self.rules)

  def _replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def jit_step(self, step_fn: Callable) -> Callable:
    """`step_fn(state, batch)` jitted with the state donated and kept in place."""
    return jax.jit(
      step_fn,
      in_shardings=(self.state_shardings, self._batch_shardings()),
      out_shardings=(self.state_shardings, self._replicated()),
      donate_argnums=0,
    )

  def jit_eval(self, eval_fn: Callable) -> Callable:
    """`eval_fn(params, batch, key)` jitted."""
    return jax.jit(
      eval_fn,
      in_shardings=(self.state_shardings.params, self._batch_shardings(), self._replicated()),
      out_shardings=self._replicated(),
    )


# Only the ranks matter for the shardings: tokens [batch, length], the rest [batch].
_BATCH_EXAMPLE = {
  "tokens": np.zeros((1, 1), np.int32),
  "prompt_len": np.zeros(1, np.int32),
  "answer_len": np.zeros(1, np.int32),
}


def make_placement(init_fn: Callable[[], TrainState], mesh: jax.sharding.Mesh, rules) -> Placement:
  """Shardings of the state `init_fn` would build (nothing is allocated)."""
  rules = tuple(tuple(rule) for rule in rules)
  abstract = jax.eval_shape(init_fn)
  shardings = sharding.state_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return Placement(mesh=mesh, rules=rules, state_shardings=shardings, abstract_state=abstract)


def init_state_fn(model_config: ModelConfig, tx: optax.GradientTransformation, seed: int) -> Callable[[], TrainState]:
  """A function building a fresh TrainState (random parameters); jit it with the placement's out_shardings."""

  def init() -> TrainState:
    _, params = nnx.split(Transformer(model_config, rngs=nnx.Rngs(params=seed)))
    return _state_from_params(params, tx, seed)

  return init


def _state_from_params(params: nnx.State, tx: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    rng=jax.random.PRNGKey(seed + 1),  # seed itself initialised the parameters
  )


def state_with_params(params: nnx.State, tx, seed: int, placement: Placement) -> TrainState:
  """A step-0 TrainState around given parameters, placed with the placement's shardings."""
  params = jax.device_put(params, placement.state_shardings.params)
  init = jax.jit(
    lambda p: _state_from_params(p, tx, seed),
    in_shardings=(placement.state_shardings.params,),
    out_shardings=placement.state_shardings,
  )
  return init(params)


# ------------------------------------------------------------------ Hugging Face init


MASK_TOKEN = "<|mask|>"


def add_mask_token(tokenizer_dir: str, out_dir: str) -> None:
  """Copy a Hugging Face tokenizer to `out_dir` with `MASK_TOKEN` added (the next free id) as its mask token."""
  import tokenizers  # only needed for HF checkpoints

  os.makedirs(out_dir, exist_ok=True)
  for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json"):
    if os.path.exists(os.path.join(tokenizer_dir, name)):
      shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
  tokenizer.add_special_tokens([tokenizers.AddedToken(MASK_TOKEN, special=True)])
  tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
  config_file = os.path.join(out_dir, "tokenizer_config.json")
  tokenizer_config = {}
  if os.path.exists(config_file):
    with open(config_file, encoding="utf-8") as f:
      tokenizer_config = json.load(f)
  tokenizer_config["mask_token"] = MASK_TOKEN
  with open(config_file, "w", encoding="utf-8") as f:
    json.dump(tokenizer_config, f, indent=2)


def resize_vocab(params: nnx.State, new_vocab: int, key: jax.Array, noise_scale: float = 1e-3) -> nnx.State:
  """Grow the embedding (and untied LM head) to `new_vocab` rows.

  New rows are the mean of the existing ones plus small Gaussian noise (scaled
  by their standard deviation): a new token then starts as an "average" token
  instead of an outlier the softmax would have to unlearn.
  """

  def grow(table: jax.Array, key: jax.Array) -> jax.Array:  # [vocab, embed]
    extra = new_vocab - table.shape[0]
    mean = table.astype(jnp.float32).mean(0)
    std = table.astype(jnp.float32).std(0)
    rows = mean + noise_scale * std * jax.random.normal(key, (extra, table.shape[1]))
    return jnp.concatenate([table, rows.astype(table.dtype)])

  embed_key, head_key = jax.random.split(key)
  params = jax.tree.map(lambda x: x, params)  # a copy whose variables we may replace
  params["embed_tokens"] = params["embed_tokens"].replace(grow(params["embed_tokens"].get_value(), embed_key))
  if "lm_head" in params:
    params["lm_head"] = params["lm_head"].replace(grow(params["lm_head"].get_value().T, head_key).T)
  return params


def load_hf_params(config: ml_collections.ConfigDict, tokens_dir: str) -> tuple[nnx.State, ModelConfig, str]:
  """Parameters, model config and tokenizer path from `config.init_from_hf`.

  If the tokenizer has no mask token, one is added (the extended tokenizer is
  written to `tokens_dir`) and the embeddings are resized to hold it, rounded
  up to a multiple of `config.vocab_multiple` so the vocabulary still shards.
  """
  from refusion_jax.checkpoints import hf as hf_io  # safetensors reading only matters for HF inits

  path = config.init_from_hf
  model = hf_io.load_hf(
    path,
    dtype=config.model.get("dtype", "float32"),
    param_dtype=config.model.get("param_dtype", None),
    config_overrides=dict(remat=config.model.get("remat", False)),
  )
  model_config = model.config
  params = nnx.state(model)
  tokenizer_path = path
  mask_id = model_config.mask_token_id
  if mask_id is None:
    if jax.process_index() == 0:  # one writer; the others read it after the barrier
      add_mask_token(path, tokens_dir)
    multihost_utils.sync_global_devices("refusion_jax: tokenizer with a mask token written")
    mask_id = load_tokenizer(tokens_dir).mask_id
    tokenizer_path = tokens_dir
    console(f"Added {MASK_TOKEN} to the tokenizer as id {mask_id} (written to {tokens_dir}).")
  if mask_id >= model_config.vocab_size:
    new_vocab = -(-(mask_id + 1) // config.vocab_multiple) * config.vocab_multiple
    params = resize_vocab(params, new_vocab, jax.random.PRNGKey(config.seed))
    console(f"Resized the vocabulary from {model_config.vocab_size} to {new_vocab} rows.")
    model_config = model_config.replace(vocab_size=new_vocab)
  model_config = _with_tokenizer_ids(model_config.replace(mask_token_id=mask_id), load_tokenizer(tokenizer_path))
  return params, model_config, tokenizer_path


# ------------------------------------------------------------------ data


def open_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """{split: random-access records}, building the tfds dataset on first use (process 0 builds, the others wait)."""
  if jax.process_index() == 0:
    splits = _open_splits(config, workdir)
  multihost_utils.sync_global_devices("refusion_jax: data built")
  return splits if jax.process_index() == 0 else _open_splits(config, workdir)


def _open_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  from refusion_jax.data import builders  # imports tensorflow-datasets

  data = config.data
  data_dir = data.data_dir or os.path.join(workdir, "data")
  if data.dataset == "tasks":
    return builders.build_refusion_tasks(
      data_dir,
      num_train=data.num_train,
      num_validation=data.num_validation,
      num_test=data.num_test,
      seed=data.seed,
      task_names=tuple(data.tasks),
    )
  if data.dataset == "json":
    files = {split: [f for f in data.get(f"{split}_files", "").split(",") if f] for split in ("train", "validation")}
    if not files["train"]:
      raise ValueError("config.data.dataset='json' needs config.data.train_files (comma-separated JSON files).")
    return builders.build_query_response_json(data_dir, {k: v for k, v in files.items() if v})
  raise ValueError(f"config.data.dataset={data.dataset!r}; choose 'tasks' or 'json'.")


def batches(source, tokenizer: Tokenizer, config: ml_collections.ConfigDict, *, train: bool):
  """The grain dataset of this process's rows: endless and shuffled for training, one ordered pass for eval."""
  return pipeline.make_dataset(
    source,
    tokenizer,
    seq_len=config.data.seq_len,
    batch_size=config.batch_size // jax.process_count(),
    seed=config.seed,
    shuffle=train,
    num_epochs=None if train else 1,
    chat_template=config.data.chat_template,
  )


# ------------------------------------------------------------------ evaluation


def decode_answers(model: Transformer, prompts: list[list[int]], config: ml_collections.ConfigDict):
  """Decode with the method matching the objective: ReFusion, AR or MDM."""
  ev = config.eval
  kind = config.objective.kind
  if kind == "refusion":
    from refusion_jax.decoding.refusion import generate

    return generate(
      model,
      prompts,
      gen_length=ev.gen_length,
      slot_size=ev.slot_size,
      serial_blocks=ev.serial_blocks,
      slot_threshold=ev.slot_threshold,
      token_threshold=ev.token_threshold,
    )
  from refusion_jax.decoding import baselines

  if kind == "ar":
    return baselines.ar_generate(model, prompts, gen_length=ev.gen_length)
  return baselines.mdm_generate(
    model, prompts, gen_length=ev.gen_length, block_length=ev.mdm_block_length, steps=ev.mdm_steps
  )


def evaluate_decoding(model: Transformer, records, tokenizer: Tokenizer, config: ml_collections.ConfigDict):
  """Exact match and tokens per forward over the first `config.eval.num_examples` records.

  Returns:
    ({exact_match, tpf, mean_forwards, exact_match_<task> per built-in task},
     [{task, query, answer, reference, correct}]).
  """
  count = min(config.eval.num_examples, len(records))
  examples = [pipeline.decode_record(records[i]) for i in range(count)]
  samples, answer_tokens, forwards = [], 0, 0
  for start in range(0, count, config.eval.batch_size):
    chunk = examples[start : start + config.eval.batch_size]
    prompts = [tokenizer.encode(_prompt_text(ex["query"], tokenizer, config)) for ex in chunk]
    result = decode_answers(model, prompts, config)
    answer_tokens += sum(len(t) for t in result.tokens)
    forwards += int(np.sum(result.num_forwards))
    for ex, tokens in zip(chunk, result.tokens):
      answer = tokenizer.decode(tokens)
      correct = _is_correct(ex, answer)
      samples.append(
        dict(task=ex.get("task", ""), query=ex["query"], answer=answer, reference=ex["response"], correct=correct)
      )
  metrics = dict(
    exact_match=float(np.mean([s["correct"] for s in samples])) if samples else 0.0,
    tpf=answer_tokens / max(forwards, 1),
    mean_forwards=forwards / max(count, 1),
  )
  by_task = {}
  for sample in samples:
    if sample["task"]:
      by_task.setdefault(sample["task"], []).append(sample["correct"])
  metrics.update({f"exact_match_{task}": float(np.mean(correct)) for task, correct in sorted(by_task.items())})
  return metrics, samples


def _prompt_text(query: str, tokenizer: Tokenizer, config) -> str:
  # Must match the pipeline's prompt (pipeline._Tokenize).
  return tokenizer.apply_chat_template(query) if config.data.chat_template else query


def _is_correct(example: dict, answer: str) -> bool:
  """Built-in tasks are checked by re-solving the query; other data by exact match with the reference."""
  if example.get("task"):
    try:
      return check_answer(example["task"], example["query"], answer)
    except ValueError:  # a task the checker does not know (user data tagged with a task name)
      pass
  return " ".join(answer.split()) == " ".join(example["response"].split())


def evaluate_loss(eval_fn: Callable, state: TrainState, records, tokenizer, config, placement: Placement) -> dict:
  """Mean training-objective metrics over the first `config.eval.num_loss_batches` validation batches.

  The objective's randomness uses a fixed key per batch, so the number is
  comparable across evaluations.
  """
  totals, count = {}, 0
  key = jax.random.PRNGKey(config.seed + 2)
  for index, batch in enumerate(batches(records, tokenizer, config, train=False)):
    if index >= config.eval.num_loss_batches:
      break
    metrics = jax.device_get(eval_fn(state.params, placement.batch(batch), jax.random.fold_in(key, index)))
    for name in ("loss", "ar_loss", "mdm_loss"):
      totals[name] = totals.get(name, 0.0) + float(metrics[name])
    count += 1
  return {name: value / max(count, 1) for name, value in totals.items()}


# ------------------------------------------------------------------ preemption


class StopSignal:
  """Turns SIGTERM into a flag the loop polls, so it can save and exit cleanly.

  Across processes the flag is OR-ed every step (all processes must save the
  same step); JAX's own preemption notice (`reached_preemption`) counts too.
  """

  def __init__(self):
    self.received = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    else:
      logging.warning("Not in the main thread: SIGTERM will not trigger a checkpoint.")

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def should_stop(self, checkpoints: Checkpoints, step: int) -> bool:
    flag = self.received
    if jax.process_count() > 1:
      flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag or checkpoints.reached_preemption(step)

  def restore(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


# ------------------------------------------------------------------ the loop


def _total_steps(config, num_train_records: int) -> int:
  if config.num_train_steps > 0:
    return config.num_train_steps
  return max(config.num_epochs * num_train_records // config.batch_size, 1)


@dataclasses.dataclass
class _Start:
  """Where the run's model comes from (see the precedence in the module docstring)."""

  model_config: ModelConfig
  tokenizer_name: str  # relative names are resolved against the checkpoint directory
  resume_step: int | None = None
  params: nnx.State | None = None  # initial parameters (HF or another run); None = random


def _find_start(config, checkpoints: Checkpoints) -> _Start:
  from refusion_jax.checkpoints import load as checkpoint_loader  # the front door for every checkpoint format

  latest = checkpoints.latest_step()
  if latest is not None:
    meta = checkpoints.read_meta(latest)
    return _Start(ModelConfig(**meta["model_config"]), meta["tokenizer"], resume_step=latest)
  init_from = config.get("init_from", "")
  init_format = checkpoint_loader.locate(init_from, config.get("init_format", "auto")).format if init_from else ""
  if init_format == "hf":
    config = config.copy_and_resolve_references()  # an HF start takes the init_from_hf path (mask token, vocab)
    config.init_from_hf = init_from
  if config.init_from_hf:
    params, model_config, tokenizer_path = load_hf_params(config, os.path.join(checkpoints.directory, "tokenizer"))
    if tokenizer_path.startswith(checkpoints.directory):
      tokenizer_path = os.path.relpath(tokenizer_path, checkpoints.directory)
    return _Start(model_config, tokenizer_path, params=params)
  if init_from:  # a run of ours, tunix or MaxText; the latter two store no config: config.model describes them
    model, tokenizer_path = checkpoint_loader.initial_model(
      init_from,
      format=init_format,
      config=model_config_from(config, load_tokenizer(config.tokenizer)) if init_format != "refusion" else None,
      dtype=config.model.get("dtype"),
      param_dtype=config.model.get("param_dtype"),
    )
    model_config = model.config.replace(remat=config.model.get("remat", False))
    return _Start(model_config, tokenizer_path or config.tokenizer, params=nnx.state(model))
  if config.init_from_checkpoint:
    model, tokenizer_path = load_model_from_checkpoint(config.init_from_checkpoint)
    return _Start(model.config, tokenizer_path, params=nnx.state(model))
  return _Start(model_config_from(config, load_tokenizer(config.tokenizer)), config.tokenizer)


def _initial_state(config, start: _Start, tx, placement: Placement, checkpoints: Checkpoints, train_iter) -> TrainState:
  if start.resume_step is not None:
    abstract = placement.abstract_state
    restored = checkpoints.restore(
      start.resume_step,
      abstract_params=abstract.params,
      abstract_train=abstract.train_part(),
      data_iterator=train_iter,
    )
    console(f"Resumed from {checkpoints.directory} at step {start.resume_step}.")
    return TrainState(params=restored.params, **restored.train)
  if start.params is not None:
    return state_with_params(start.params, tx, config.seed, placement)
  init = jax.jit(init_state_fn(start.model_config, tx, config.seed), out_shardings=placement.state_shardings)
  return init()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Train (resuming from `workdir` if it holds checkpoints), evaluate, checkpoint; see the module docstring.

  `workdir` must be a path every process sees (local disk for one process;
  NFS / gcsfuse for a pod).

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN/Inf; no checkpoint
      of that step or later was written.
  """
  workdir = local_path(workdir)
  os.makedirs(workdir, exist_ok=True)
  stop_signal = StopSignal()
  checkpoints = Checkpoints(
    os.path.join(workdir, CHECKPOINT_SUBDIR),
    max_to_keep=config.checkpoint.max_to_keep,
    async_save=config.checkpoint.async_save,
  )
  try:
    return _train_loop(config, workdir, checkpoints, stop_signal)
  finally:
    checkpoints.wait()
    checkpoints.close()
    stop_signal.restore()


def _check_batch_size(config, mesh) -> None:
  sharding.check_batch_divisible(config.batch_size, mesh, config.sharding_rules)
  if config.batch_size % (config.grad_accum_steps * jax.process_count()):
    raise ValueError(
      f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps} "
      f"times the process count {jax.process_count()}."
    )


def _train_loop(config, workdir, checkpoints: Checkpoints, stop_signal: StopSignal) -> TrainResult:
  splits = open_splits(config, workdir)
  validation = splits.get("validation")
  total_steps = _total_steps(config, len(splits["train"]))
  tx, schedule = make_optimizer(config.optimizer, total_steps)
  mesh = sharding.make_mesh(dict(config.mesh))
  _check_batch_size(config, mesh)

  start = _find_start(config, checkpoints)
  tokenizer = _resolve_tokenizer(start.tokenizer_name, checkpoints.directory)
  placement = make_placement(init_state_fn(start.model_config, tx, config.seed), mesh, config.sharding_rules)
  train_iter = iter(batches(splits["train"], tokenizer, config, train=True))
  state = _initial_state(config, start, tx, placement, checkpoints, train_iter)

  objective = objective_config_from(config, start.model_config)
  graphdef, _ = abstract_model(start.model_config)
  step_fn = placement.jit_step(make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps))
  eval_fn = placement.jit_eval(make_eval_step(graphdef, objective))
  meta = model_meta(start.model_config, start.tokenizer_name, objective=objective.kind)
  step = int(state.step)
  logger = MetricsLogger(workdir, total_steps=total_steps, initial_step=step)
  result = TrainResult(step=step, losses={}, evals=[], samples=[], stopped_by="finished")
  last_saved = start.resume_step

  def save():
    nonlocal last_saved
    checkpoints.save(step, params=state.params, train=state.train_part(), data_iterator=train_iter, meta=meta)
    last_saved = step

  def run_eval():
    metrics = evaluate_loss(eval_fn, state, validation, tokenizer, config, placement)
    decoded, result.samples = evaluate_decoding(nnx.merge(graphdef, state.params), validation, tokenizer, config)
    metrics.update(decoded)
    logger.write(step, metrics, "eval")
    logger.write_text(step, "eval/samples", _format_samples(result.samples[: config.num_samples_to_print]))
    result.evals.append((step, metrics))

  last_time, tokens_since = time.perf_counter(), 0
  try:
    while step < total_steps:
      batch = next(train_iter)
      tokens_since += int(np.sum(batch["prompt_len"] + batch["answer_len"]))
      state, metrics = step_fn(state, placement.batch(batch))
      step += 1
      metrics = jax.device_get(metrics)
      _check_finite(metrics, step, last_saved, checkpoints)
      result.losses[step] = float(metrics["loss"])
      logger.step(result.losses[step])
      if step % config.log_every == 0 or step == total_steps:
        elapsed = time.perf_counter() - last_time
        scalars = {k: float(v) for k, v in metrics.items() if not k.startswith("num_")}
        logger.write(step, dict(scalars, tokens_per_second=tokens_since / elapsed), "train")
        last_time, tokens_since = time.perf_counter(), 0
      if validation is not None and config.eval_every > 0 and (step % config.eval_every == 0 or step == total_steps):
        run_eval()
      if step % config.checkpoint.every == 0 or step == total_steps:
        save()
      if stop_signal.should_stop(checkpoints, step):
        result.stopped_by = "preempted"
      elif step == config.stop_after_step:
        result.stopped_by = "stop_after_step"
      else:
        continue
      if last_saved != step:
        save()
      console(f"Stopping at step {step} ({result.stopped_by}); checkpoint saved in {checkpoints.directory}.")
      break
  finally:
    logger.close()
  result.step = step
  if result.samples:
    _print_samples(result, config)
  return result


def _check_finite(metrics: dict, step: int, last_saved: int | None, checkpoints: Checkpoints) -> None:
  """Stop before anything of a step with a NaN/Inf loss or gradient norm is saved."""
  loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
  if math.isfinite(loss) and math.isfinite(grad_norm):
    return
  checkpoints.wait()
  raise NonFiniteLossError(
    f"Non-finite loss or gradient at step {step} (loss={loss}, grad_norm={grad_norm}); stopping. "
    f"Nothing was saved for this step: the last good checkpoint is step {last_saved} in "
    f"{checkpoints.directory}. Lower optimizer.lr or check the data, then rerun to resume from it."
  )


def _resolve_tokenizer(name: str, checkpoint_dir: str) -> Tokenizer:
  local = os.path.join(checkpoint_dir, name)
  return load_tokenizer(local if os.path.isdir(local) else name)


def _format_samples(samples: list[dict]) -> str:
  return "\n".join(
    f"[{'ok' if s['correct'] else 'wrong'}] {s['query']!r} -> {s['answer']!r} (reference {s['reference']!r})"
    for s in samples
  )


def _print_samples(result: TrainResult, config) -> None:
  step, metrics = result.evals[-1]
  lines = [f"Samples at step {step}:", _format_samples(result.samples[: config.num_samples_to_print])]
  by_task = ", ".join(
    f"{key.removeprefix('exact_match_')} {value:.3f}"
    for key, value in metrics.items()
    if key.startswith("exact_match_")
  )
  lines.append(
    f"Validation exact match {metrics['exact_match']:.3f} over {len(result.samples)} examples"
    + (f" ({by_task})" if by_task else "")
    + f", tokens per forward {metrics['tpf']:.2f}."
  )
  console("\n".join(lines))
