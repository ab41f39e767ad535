"""The ahead-of-time report of a training config: its training step and ReFusion decode loop compiled for a
topology (or the local devices), with per-device memory, FLOPs, and what to change when something does not fit.

The numbers are `parallel/compiled.py`'s (`compile_report`): this module builds the two programs as
`refusion_jax.train` and `rj.decode(..., mesh=)` run them, from the config's shapes alone. Shapes come from
`config.model` (preset + overrides), not from `init_from`; special token ids the config leaves unset get
placeholders (they do not change the compiled program). `python -m refusion_jax.aot` prints the reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from refusion_jax.decoding.contract import Decoder
from refusion_jax.decoding.engine import engine_decoder
from refusion_jax.decoding.loop import loop_for, start_state
from refusion_jax.decoding.mesh import padded_rows
from refusion_jax.decoding.methods import config_method
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.model import flops, lora
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.lora import LoraConfig
from refusion_jax.model.transformer import inference_config, init_model
from refusion_jax.parallel import compiled, sharding
from refusion_jax.parallel.activations import normalize_rules, sharded_activations
from refusion_jax.parallel.mesh_spec import format_mesh_spec
from refusion_jax.training.run_config import (
  check_quantize,
  lora_config_from,
  objective_config_from,
  preset_with_overrides,
  quantized_as_configured,
)
from refusion_jax.training.state import Placement, init_state_fn, make_optimizer, make_placement, make_train_step


def model_config_of(config: ml_collections.ConfigDict) -> ModelConfig:
  """`config.model` (preset + overrides) with `config.quantize`, and placeholder special ids where the config
  has none."""
  model_config = quantized_as_configured(preset_with_overrides(config.model), config)
  last = model_config.vocab_size - 1
  return model_config.replace(
    mask_token_id=model_config.mask_token_id if model_config.mask_token_id is not None else last,
    pad_token_id=model_config.pad_token_id if model_config.pad_token_id is not None else last,
    eos_token_id=model_config.eos_token_id if model_config.eos_token_id is not None else last,
  )


def mesh_devices(mesh_shape: dict[str, int], devices: Sequence[jax.Device]) -> list[jax.Device]:
  """The first devices a mesh needs (all of them when an axis is -1)."""
  if -1 in mesh_shape.values():
    return list(devices)
  needed = math.prod(mesh_shape.values())
  if needed > len(devices):
    raise ValueError(f"The mesh {mesh_shape} needs {needed} devices; the topology has {len(devices)}.")
  return list(devices[:needed])


@dataclasses.dataclass(frozen=True)
class AbstractRun:
  """A training run built from a config's shapes alone on a topology's devices: what its compiled steps take
  (the placement's state is abstract; nothing is allocated)."""

  model_config: ModelConfig
  rules: Any
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  lora_config: LoraConfig
  placement: Placement
  graphdef: nnx.GraphDef


def abstract_run(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device], rows: int, total_steps: int
) -> AbstractRun:
  """The run of `config` on the config's mesh over `devices`, its steps taking `rows` rows (checked to split over
  the mesh and `config.grad_accum_steps`) and its schedule `total_steps` optimizer updates long."""
  model_config = model_config_of(config)
  rules = normalize_rules(config.sharding_rules)
  mesh = sharding.make_mesh(dict(config.mesh), mesh_devices(dict(config.mesh), devices))
  # One process compiles for the whole topology; the job's processes do not change the per-device split.
  sharding.check_batch_split(rows, config.grad_accum_steps, mesh, rules, processes=1)
  tx, schedule = make_optimizer(config.optimizer, total_steps=total_steps)
  lora_config = lora_config_from(config)
  check_quantize(config)
  placement = make_placement(init_state_fn(model_config, tx, config.seed, lora_config), mesh, rules)
  graphdef, _ = lora.abstract_lora_model(model_config, lora_config)
  return AbstractRun(model_config, rules, mesh, tx, schedule, lora_config, placement, graphdef)


def step_report(
  name: str, step: Any, args: tuple, run: AbstractRun, chip: compiled.Chip | None, loop_count: int = 1
) -> compiled.Report:
  """The compile report of the jitted `step` on `args` (abstract, on `run`'s mesh), FLOPs per chip of the mesh
  (which may use fewer chips than the topology has: a one-chip mesh on v5p:2x2x1)."""
  traced = step.trace(*args)
  devices = list(run.mesh.devices.flat)
  report = compiled.compile_report(name, traced.lower, args, devices, chip, loop_count=loop_count)
  report.traced_flops = compiled.matmul_flops(traced.jaxpr) / run.mesh.devices.size
  if run.model_config.scan_layers:  # XLA's cost analysis counts the scan's one layer once: no FLOPs, not wrong ones
    report.flops = report.bytes_accessed = None
  return report


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def train_report(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device], chip: compiled.Chip | None
) -> compiled.Report:
  """Compile the training step as `refusion_jax.train` would run it, with the activations sharded like the batch."""
  run = abstract_run(config, devices, config.batch_size, max(config.num_train_steps, 1))
  model_config, rules, mesh, lora_config = run.model_config, run.rules, run.mesh, run.lora_config
  accum = config.grad_accum_steps
  ways = sharding.batch_parallel_ways(mesh, rules)
  objective = objective_config_from(config, model_config)
  step_fn = sharded_activations(make_train_step(run.graphdef, run.tx, run.schedule, objective, accum), mesh, rules)
  step = run.placement.jit_step(step_fn)
  # Packed rows give each row's example lengths, [batch, max_segments]; unpacked rows one length each.
  lengths = (config.batch_size, config.data.max_segments) if config.data.packing else (config.batch_size,)
  shapes = {"tokens": (config.batch_size, config.data.seq_len), "prompt_len": lengths, "answer_len": lengths}
  batch = {
    key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(mesh, len(shape), rules))
    for key, shape in shapes.items()
  }
  name = (
    f"train step{f', LoRA r={lora_config.rank}' if lora_config.enabled else ''}{quantized_text(model_config)}, "
    f"batch {config.batch_size} x {config.data.seq_len}, grad_accum {accum}, "
    f"remat {model_config.remat}{', layers scanned' if model_config.scan_layers else ''}, mesh {mesh_text(mesh)}"
  )
  report = step_report(name, step, (run.placement.abstract_state, batch), run, chip, loop_count=accum)
  # MFU is judged on rows full of real tokens (packed rows come close): one causal example of seq_len per row.
  rows = [config.data.seq_len] * config.batch_size
  causal = objective.kind != "mdm"
  report.model_flops = flops.training_flops(model_config, rows, causal, lora_config) / mesh.devices.size
  report.advice = train_advice(report, config, model_config, ways)
  return report


def decode_report(
  config: ml_collections.ConfigDict,
  devices: Sequence[jax.Device],
  chip: compiled.Chip | None,
  batch: int,
  prompt_length: int,
  mesh_shape: dict[str, int],
) -> compiled.Report:
  """Compile the ReFusion decode loop as `rj.decode(..., mesh=)` runs a batch of `batch` prompts on that mesh.

  The loop runs on the inference view of the model (no remat, weights in compute dtype), with its rows
  padded to a multiple of the mesh's batch-parallel devices, as `rj.decode` pads them: a batch smaller than
  the mesh fits it.
  """
  model_config = inference_config(model_config_of(config))
  rules = normalize_rules(config.sharding_rules)
  mesh = sharding.make_mesh(mesh_shape, mesh_devices(mesh_shape, devices))
  graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(model_config)))
  method = config_method("refusion", config.eval)  # the ReFusion value validation decodes with, greedy
  decoder = engine_decoder(model_config, method, DecodeOptions(mesh=mesh), rules)
  rows, ways = padded_rows(batch, mesh, rules), sharding.batch_parallel_ways(mesh, rules)
  padding = f" as {rows} rows (a multiple of {ways} batch-parallel devices)" if rows != batch else ""
  name = (
    f"decode (prefill + 1 loop iteration), batch {batch}{padding}, prompt {prompt_length} + {method.gen_length} "
    f"(S={method.slot_size}, {method.serial_blocks} blocks), {model_config.param_dtype} weights"
    f"{quantized_text(model_config)}, mesh {mesh_text(mesh)}"
  )
  report = loop_report(name, decoder, graphdef, params, model_config, rows, prompt_length, mesh, rules, chip)
  if report.fits is False:
    report.advice = [
      f"decode batch {batch} does not fit: lower --decode_batch, or split the weights over more chips "
      f"with a tensor-parallel mesh (--decode_mesh=tensor:N, N dividing {model_config.num_kv_heads} KV heads)"
      + ("." if model_config.quantize == "int4" else ", or quantize the projections (--quantize int8 or int4).")
    ]
  return report


def loop_report(
  name: str,
  decoder: Decoder,
  graphdef: nnx.GraphDef,
  params: nnx.State,
  model_config: ModelConfig,
  rows: int,
  prompt_length: int,
  mesh: jax.sharding.Mesh,
  rules: tuple,
  chip: compiled.Chip | None,
) -> compiled.Report:
  """Compile `decoder`'s loop as an `Engine` of `rows` rows and prompt bucket `prompt_length` runs it on `mesh`,
  for the abstract inference-view `params` of a model of `model_config` (prefill + 1 loop iteration)."""
  loop = loop_for(decoder, graphdef, mesh, rules)
  state = start_state(decoder, model_config, rows, prompt_length)
  param_shardings, state_shardings, replicated, _ = loop.shardings(params, state)
  params, state = _abstract(params, param_shardings), _abstract(state, state_shardings)
  knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), decoder.knobs)
  max_iterations = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  lower = lambda: loop.lower(params, state, max_iterations, knobs)
  return compiled.compile_report(name, lower, (params, state, knobs), list(mesh.devices.flat), chip)


def quantized_text(model_config: ModelConfig) -> str:
  """ ", int8 projections" (or int4 with its group size) for a report's name; "" for float ones."""
  if model_config.quantize == "none":
    return ""
  group = f" g{model_config.quantize_group_size or 'channel'}" if model_config.quantize == "int4" else ""
  return f", {model_config.quantize}{group} projections"


def train_advice(
  report: compiled.Report, config: ml_collections.ConfigDict, model_config: ModelConfig, ways: int
) -> list[str]:
  """What to change when the training step does not fit (empty when it fits or the HBM is unknown)."""
  if report.fits is not False:
    return []
  hbm = report.chip.hbm_bytes
  advice = []
  if report.arguments is not None and report.arguments > 0.8 * hbm:
    advice.append(
      f"parameters + optimizer state alone take {report.arguments / 1e9:.1f} GB per chip: shard them over "
      f"more chips (a larger topology with config.mesh.fsdp=-1)."
    )
  if model_config.remat != "full":
    advice.append("set --config.model.remat=full (each layer keeps only its input for the backward pass).")
  if model_config.attention_impl in ("xla", "dot_product") and config.data.seq_len > model_config.attention_chunk:
    advice.append(
      "set --config.model.attention_impl=auto (the fused kernel on TPU / GPU) or chunked (one query chunk's "
      "scores at a time)."
    )
  accum, per_device = config.grad_accum_steps, config.batch_size // ways
  # Activations scale with the microbatch, the state does not: an estimate from this compile (after an
  # out-of-memory compile its temporaries are a lower bound, so the estimate may fall short; rerun to check).
  needed = accum * 2
  if report.total is not None:
    needed = (report.total - report.arguments) * accum / max(0.9 * hbm - report.arguments, 1.0)
  choices = [k for k in range(accum + 1, per_device + 1) if per_device % k == 0 and k >= needed]
  if choices:
    advice.append(
      f"raise --config.grad_accum_steps to {choices[0]} (estimated from this compile; "
      f"it must divide the {per_device} rows per batch-parallel device)."
    )
  else:
    advice.append(f"lower --config.batch_size (now {config.batch_size}) or add chips.")
  return advice


def mesh_text(mesh: jax.sharding.Mesh) -> str:
  """The mesh's axes of more than one device as `--decode_mesh` takes them, e.g. "data:2+tensor:4" ("1 device")."""
  return format_mesh_spec(mesh.shape) or "1 device"


def decode_mesh_ways(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device], mesh_shape: dict[str, int]
) -> tuple[str, int]:
  """(the decode mesh as text, its batch-parallel devices: what a decode batch's rows are padded to a multiple of)."""
  mesh = sharding.make_mesh(mesh_shape, mesh_devices(mesh_shape, devices))
  return mesh_text(mesh), sharding.batch_parallel_ways(mesh, normalize_rules(config.sharding_rules))


def train_reports(
  config: ml_collections.ConfigDict,
  devices: Sequence[jax.Device],
  chip: compiled.Chip | None,
  remat_policies: Sequence[str] = (),
) -> Iterator[compiled.Report]:
  """The training step compiled once per `remat_policies` entry (or at the config's remat), one at a time
  (big compiles are CPU-heavy), yielding each report as it is done."""
  for policy in remat_policies or [config.model.remat]:
    with_policy = config.copy_and_resolve_references()
    with_policy.model.remat = policy
    yield train_report(with_policy, devices, chip)


def decode_reports(
  config: ml_collections.ConfigDict,
  devices: Sequence[jax.Device],
  chip: compiled.Chip | None,
  batches: Sequence[int],
  prompt_length: int,
  mesh_shape: dict[str, int],
) -> Iterator[compiled.Report]:
  """The decode loop compiled once per batch of `batches`, one at a time, yielding each report as it is done."""
  for batch in batches:
    yield decode_report(config, devices, chip, batch, prompt_length, mesh_shape)
