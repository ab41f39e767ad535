"""The train state, where it lives on the mesh, the optimizer, and the jitted step functions.

- `TrainState`: everything that moves through the step (a `flax.struct` pytree).
- `make_optimizer`: AdamW after clipping, warmup then decay; weight decay by
  parameter role (kernels and embeddings), never by rank.
- `make_train_step` / `make_eval_step`: the step functions, gradient
  accumulation being a `lax.scan` over microbatches inside the step;
  `make_update_step`: the same update around any loss (GRPO's, refusion_jax.rl).
- `Placement` / `make_placement`: the mesh shardings of the state, and the
  functions jitted with them.
- `init_state_fn` / `state_with_params`: a fresh state, random or around given
  parameters, created where it lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from refusion_jax.model import lora
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel import hosts, sharding
from refusion_jax.training.objective import ObjectiveConfig, loss_fn

# A training step's input: tokens, prompt_len, answer_len (data/pipeline.py's batch contract), on host or device.
TrainBatch = Mapping[str, Any]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  """Everything that moves through the jitted step.

  step:      [] int32, optimizer updates applied so far.
  params:    the model's `nnx.State` (`nnx.Param` leaves with logical axes).
  opt_state: the optax state (its moments mirror the trainable part of `params`, axes included: all of
             them, or only the LoRA adapters of a model that carries some, `lora.trainable_part`).
  rng:       [2] uint32 base key; step k draws from fold_in(rng, k), so a resumed
             run draws exactly what an uninterrupted one would.
  """

  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  rng: jax.Array

  def train_part(self) -> dict[str, Any]:
    """What the `train` checkpoint item holds (all but the parameters)."""
    return dict(step=self.step, opt_state=self.opt_state, rng=self.rng)


# ------------------------------------------------------------------ optimizer


# Weight decay pulls a weight towards zero. That is a prior on kernels and
# embeddings; on a bias or a norm scale (whose neutral value is 1) it only
# distorts the function, whatever the array's rank (Qwen2's q/k/v biases are
# [heads, head_dim]).
_DECAYED_SUFFIXES = ("_proj",)
_DECAYED_NAMES = ("embed_tokens", "lm_head")


def _parameter_names(path: tuple) -> list[str]:
  keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return [k for k in keys if k != "value"]


def decays(path: tuple) -> bool:
  """Whether the parameter at a pytree `path` of the model's state gets weight decay, by its role.

  Raises:
    ValueError: the parameter is neither a kernel, an embedding, a bias nor a
      norm scale (a new kind of parameter must be given a role here).
  """
  names = _parameter_names(path)
  leaf = names[-1]
  if leaf in lora.ADAPTER_WEIGHTS:  # low-rank factors of a kernel: decayed as peft + transformers' Trainer do
    return True
  if leaf in _DECAYED_NAMES or leaf.endswith(_DECAYED_SUFFIXES):
    return True
  if leaf.endswith("_bias") or (leaf == "weight" and len(names) > 1 and names[-2].endswith("norm")):
    return False
  raise ValueError(
    f"Parameter {'.'.join(names)!r} is neither a kernel, an embedding, a bias nor a norm scale: "
    "give it a weight-decay role in refusion_jax.training.state.decays."
  )


def weight_decay_mask(params: nnx.State) -> Any:
  """The pytree of `params` with True where AdamW decays the parameter (see `decays`)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def make_optimizer(
  opt: ml_collections.ConfigDict, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW after global-norm clipping, with linear warmup then `opt.decay` ("cosine", "linear", "constant").

  Weight decay applies to kernels and embeddings only (`decays`).
  """
  decay_steps = max(total_steps - opt.warmup_steps, 1)
  end_lr = opt.lr * opt.final_lr_ratio
  decays_by_name = {
    "cosine": optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.final_lr_ratio),
    "linear": optax.linear_schedule(opt.lr, end_lr, decay_steps),
    "constant": optax.constant_schedule(opt.lr),
  }
  if opt.decay not in decays_by_name:
    raise ValueError(f"optimizer.decay={opt.decay!r}; choose one of {sorted(decays_by_name)}.")
  warmup = optax.linear_schedule(0.0, opt.lr, opt.warmup_steps)
  schedule = optax.join_schedules([warmup, decays_by_name[opt.decay]], [opt.warmup_steps])
  tx = optax.chain(
    optax.clip_by_global_norm(opt.grad_clip),
    optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=weight_decay_mask),
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
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
  """The (un-jitted) step: average gradients over `grad_accum_steps` microbatches, one AdamW update.

  Batch: tokens [batch, length], prompt_len and answer_len [batch, segments] (packed rows) or [batch].
  Metrics: loss, ar_loss, mdm_loss, num_ar_tokens, num_mdm_tokens (microbatch
  means), grad_norm (before clipping), learning_rate (of this update).

  A model with LoRA adapters trains only them (`lora.trainable_part`): gradients are taken with respect
  to the adapters alone, so no weight gradient of a frozen kernel is ever computed, and the optimizer
  state mirrors the adapters only.
  """

  def loss_of(model: nnx.Module, batch: TrainBatch, key: jax.Array) -> tuple[jax.Array, Metrics]:
    return loss_fn(model, batch, key, objective, dropout_key=lora.dropout_key(model, key))

  return make_update_step(graphdef, tx, schedule, loss_of, grad_accum_steps)


# (model, microbatch, key) -> (scalar loss, metrics): what an update step differentiates.
LossOfModel = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, Metrics]]


def make_update_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  loss_of_model: LossOfModel,
  grad_accum_steps: int,
  updates_per_step: int = 1,
) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
  """(state, batch) -> (state, metrics): `updates_per_step` optimizer updates on the same batch (GRPO's
  iterations, refusion_jax.rl), each averaging the gradients of `grad_accum_steps` microbatches; the step counter
  advances by one.

  Every leaf of the batch has the batch axis first. Metrics: `loss_of_model`'s (means over microbatches and
  updates), grad_norm (before clipping, the mean over the updates), learning_rate (of the first update: the
  schedule counts updates, `updates_per_step` of them per step). Only the trainable part of the parameters
  (`lora.trainable_part`: every parameter, or the LoRA adapters) gets gradients.
  """

  def loss_of(trainable: nnx.State, frozen: nnx.State, batch: Any, key: jax.Array) -> tuple[jax.Array, Metrics]:
    return loss_of_model(nnx.merge(graphdef, trainable, frozen), batch, key)

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
    key = jax.random.fold_in(state.rng, state.step)
    micro = jax.tree.map(lambda x: _microbatches(x, grad_accum_steps), batch)
    trainable, frozen = lora.trainable_part(state.params)
    first = jax.tree.map(lambda x: x[0], micro)
    (_, metrics_shape), grads_shape = jax.eval_shape(grad_fn, trainable, frozen, first, key)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, metrics_shape))

    def update(carry: tuple[Any, Any], update_index: jax.Array) -> tuple[tuple[Any, Any], Metrics]:
      trainable, opt_state = carry
      update_key = key if updates_per_step == 1 else jax.random.fold_in(key, update_index)

      def accumulate(carry: tuple[Any, Metrics], inputs: tuple[jax.Array, Any]) -> tuple[tuple[Any, Metrics], None]:
        index, microbatch = inputs
        (_, metrics), grads = grad_fn(trainable, frozen, microbatch, jax.random.fold_in(update_key, index))
        return jax.tree.map(jnp.add, carry, (grads, metrics)), None

      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum_steps), micro))
      grads, metrics = jax.tree.map(lambda x: x / grad_accum_steps, (grads, metrics))
      updates, opt_state = tx.update(grads, opt_state, trainable)
      return (optax.apply_updates(trainable, updates), opt_state), dict(metrics, grad_norm=optax.global_norm(grads))

    if updates_per_step == 1:
      (trainable, opt_state), metrics = update((trainable, state.opt_state), jnp.int32(0))
    else:
      (trainable, opt_state), metrics = jax.lax.scan(update, (trainable, state.opt_state), jnp.arange(updates_per_step))
      metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), metrics)
    params = nnx.merge_state(trainable, frozen)
    metrics = dict(metrics, learning_rate=schedule(state.step * updates_per_step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return step


def make_eval_step(
  graphdef: nnx.GraphDef, objective: ObjectiveConfig
) -> Callable[[nnx.State, TrainBatch, jax.Array], Metrics]:
  """(params, batch, key) -> metrics of the training loss, without gradients."""

  def eval_step(params: nnx.State, batch: TrainBatch, key: jax.Array) -> Metrics:
    return loss_fn(nnx.merge(graphdef, params), batch, key, objective)[1]

  return eval_step


# ------------------------------------------------------------------ placement


# Only the ranks matter for the shardings: tokens [batch, length], the rest [batch] (a [batch, segments] array of
# packed rows takes the same split: its segments axis is left whole).
_BATCH_EXAMPLE = {
  "tokens": np.zeros((1, 1), np.int32),
  "prompt_len": np.zeros(1, np.int32),
  "answer_len": np.zeros(1, np.int32),
}


@dataclasses.dataclass
class Placement:
  """The mesh, the shardings of the train state, and the jitted functions that use them."""

  mesh: jax.sharding.Mesh
  rules: tuple
  state_shardings: TrainState
  abstract_state: TrainState  # ShapeDtypeStructs carrying `state_shardings`

  def batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of a batch -> global arrays sharded over the mesh."""
    return sharding.shard_batch(batch, self.mesh, self.rules)

  def _batch_shardings(self, example: Mapping[str, Any] | None = None) -> dict:
    return sharding.batch_shardings(_BATCH_EXAMPLE if example is None else example, self.mesh, self.rules)

  def _replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def jit_step(
    self,
    step_fn: Callable[[TrainState, Any], tuple[TrainState, Metrics]],
    batch_example: Mapping[str, Any] | None = None,
  ) -> Callable:
    """`step_fn(state, batch)` jitted with the state donated and kept in place; the batch is split by rows
    (`batch_example`: its keys and ranks, default the training batch's: tokens, prompt_len, answer_len)."""
    return jax.jit(
      step_fn,
      in_shardings=(self.state_shardings, self._batch_shardings(batch_example)),
      out_shardings=(self.state_shardings, self._replicated()),
      donate_argnums=0,
    )

  def jit_eval(self, eval_fn: Callable[[nnx.State, TrainBatch, jax.Array], Metrics]) -> Callable:
    """`eval_fn(params, batch, key)` jitted."""
    return jax.jit(
      eval_fn,
      in_shardings=(self.state_shardings.params, self._batch_shardings(), self._replicated()),
      out_shardings=self._replicated(),
    )


def make_placement(init_fn: Callable[[], TrainState], mesh: jax.sharding.Mesh, rules: Any) -> Placement:
  """Shardings of the state `init_fn` would build (nothing is allocated)."""
  rules = tuple(tuple(rule) for rule in rules)
  abstract = jax.eval_shape(init_fn)
  shardings = sharding.state_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return Placement(mesh=mesh, rules=rules, state_shardings=shardings, abstract_state=abstract)


# ------------------------------------------------------------------ fresh states


def init_state_fn(
  model_config: ModelConfig, tx: optax.GradientTransformation, seed: int, lora_config: lora.LoraConfig | None = None
) -> Callable[[], TrainState]:
  """A function building a fresh TrainState (random parameters, and adapters when `lora_config` asks for
  them); jit it with the placement's out_shardings."""

  def init() -> TrainState:
    model = Transformer(model_config, rngs=nnx.Rngs(params=seed))
    _, params = nnx.split(lora.add_lora(model, lora_config or lora.LoraConfig(), seed))
    return _state_from_params(params, tx, seed)

  return init


def _state_from_params(params: nnx.State, tx: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(lora.trainable_part(params)[0]),
    rng=jax.random.PRNGKey(seed + 1),  # seed itself initialised the parameters
  )


def state_with_params(
  params: nnx.State, tx: optax.GradientTransformation, seed: int, placement: Placement
) -> TrainState:
  """A step-0 TrainState around given parameters, placed with the placement's shardings (`hosts.place`: on a
  mesh spanning processes as well)."""
  params = hosts.place(params, placement.state_shardings.params)
  init = jax.jit(
    lambda p: _state_from_params(p, tx, seed),
    in_shardings=(placement.state_shardings.params,),
    out_shardings=placement.state_shardings,
  )
  return init(params)
