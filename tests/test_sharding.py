"""Mesh construction, the logical-axis rules, and sharded == single-device training."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.parallel import sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_minus_one_fills_the_remaining_devices():
  devices = jax.devices()[:1]
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_mesh_that_does_not_fit_the_devices_is_rejected():
  with pytest.raises(ValueError, match="needs 4 devices but there are 1"):
    sharding.make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:1])
  with pytest.raises(ValueError, match="Unknown mesh axes"):
    sharding.make_mesh({"model": 1}, jax.devices()[:1])


def test_rules_map_every_parameter_to_mesh_axes():
  model = init_model(tiny(), seed=0)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = sharding.state_shardings(nnx.state(model), mesh)
  assert shardings["layers"][0]["self_attn"]["q_proj"].get_value().spec == PartitionSpec("fsdp", "tensor", None)
  assert shardings["embed_tokens"].get_value().spec == PartitionSpec("tensor", "fsdp")
  assert shardings["layers"][1]["mlp"]["down_proj"].get_value().spec == PartitionSpec("tensor", "fsdp")


def test_unmapped_logical_axis_is_named():
  model = init_model(tiny(), seed=0)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  rules = tuple(rule for rule in sharding.LOGICAL_AXIS_RULES if rule[0] != "mlp")
  with pytest.raises(ValueError, match=r"\['mlp'\]"):
    sharding.state_shardings(nnx.state(model), mesh, rules)


# Runs in a subprocess: the device count must be set before JAX initialises.
_SHARDED_VS_SINGLE = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    import ml_collections, numpy as np
    from flax import nnx
    from refusion_jax.parallel import sharding
    from refusion_jax.training import state as train
    from refusion_jax.model.transformer import abstract_model
    from refusion_jax.model.config import tiny
    from refusion_jax.training.objective import ObjectiveConfig

    model_config = tiny(vocab_size=260, mask_token_id=259, pad_token_id=256, eos_token_id=258)
    # eps=1e-6, not 1e-8: Adam moves a parameter by up to lr x |g| / (|g| + eps), so a gradient entry near eps took
    # the sharded sum's rounding x lr / eps into the parameters (4.8e-5 of the 5e-5 bound at seed 34; 4.8e-6 now).
    opt = ml_collections.ConfigDict(dict(lr=1e-3, warmup_steps=1, decay="cosine", final_lr_ratio=0.1,
        weight_decay=0.01, b1=0.9, b2=0.98, eps=1e-6, grad_clip=1.0))
    tx, schedule = train.make_optimizer(opt, total_steps=10)
    objective = ObjectiveConfig(kind="refusion", mask_id=259, pad_id=256, slot_sizes=(2, 4))
    graphdef, _ = abstract_model(model_config)

    rng = np.random.default_rng(int(sys.argv[1]))
    def random_batch(batch=8, length=32):
      prompt_len = rng.integers(1, 10, batch)
      answer_len = rng.integers(1, length - prompt_len + 1)
      tokens = rng.integers(0, 256, (batch, length))
      tokens[np.arange(length)[None] >= (prompt_len + answer_len)[:, None]] = 256
      return dict(tokens=tokens.astype(np.int32), prompt_len=prompt_len.astype(np.int32),
                  answer_len=answer_len.astype(np.int32))
    batches = [random_batch() for _ in range(2)]

    def run(mesh_shape, devices):
      mesh = sharding.make_mesh(mesh_shape, devices)
      init = train.init_state_fn(model_config, tx, seed=0)
      placement = train.make_placement(init, mesh, sharding.LOGICAL_AXIS_RULES)
      state = jax.jit(init, out_shardings=placement.state_shardings)()
      step = placement.jit_step(train.make_train_step(graphdef, tx, schedule, objective, grad_accum_steps=2))
      losses = []
      for batch in batches:
        state, metrics = step(state, placement.batch(batch))
        losses.append(float(metrics["loss"]))
      q_proj = state.params["layers"][0]["self_attn"]["q_proj"].get_value()
      params = {k: np.asarray(v) for k, v in nnx.to_flat_state(jax.device_get(state.params))}
      return losses, params, q_proj

    single_losses, single_params, _ = run({"data": 1}, jax.devices()[:1])
    sharded_losses, sharded_params, q_proj = run({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    diff = max(float(np.max(np.abs(single_params[k] - sharded_params[k]))) for k in single_params)
    print(json.dumps(dict(
        single_losses=single_losses, sharded_losses=sharded_losses, max_param_diff=diff,
        q_proj_spec=list(q_proj.sharding.spec), q_proj_shard_shape=list(q_proj.addressable_shards[0].data.shape),
        q_proj_shape=list(q_proj.shape), devices=len(jax.devices()))))
""")


def test_sharded_step_matches_single_device():
  seed = int(np.random.default_rng().integers(1 << 16))
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run(
    [sys.executable, "-c", _SHARDED_VS_SINGLE, str(seed)],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["devices"] == 8
  # The parameters really are split: embed over fsdp (2 ways), heads over tensor (2 ways).
  assert report["q_proj_spec"] == ["fsdp", "tensor", None]
  assert report["q_proj_shard_shape"] == [
    report["q_proj_shape"][0] // 2,
    report["q_proj_shape"][1] // 2,
    report["q_proj_shape"][2],
  ]
  np.testing.assert_allclose(report["sharded_losses"], report["single_losses"], rtol=1e-5, atol=1e-5)
  # Adam's step is scale-free (m / sqrt(v) ~ sign of the gradient), so a parameter whose gradient is near eps
  # moves by up to lr x (rounding of its gradient / eps): the sharded sums' other order shows up there (the
  # optimizer's eps above bounds it). A twentieth of the 1e-3 learning rate still catches any real divergence.
  assert report["max_param_diff"] < 5e-5, (seed, report)
