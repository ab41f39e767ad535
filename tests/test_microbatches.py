"""Under gradient accumulation every microbatch stays split evenly over the batch-parallel devices."""

import textwrap

import jax
import pytest
from helpers.fake_devices import run_json
from helpers.train_utils import smoke_config

from refusion_jax.parallel.sharding import check_batch_split, make_mesh

_SHARDS = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    from refusion_jax.parallel import sharding
    from refusion_jax.training.state import _microbatches

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rows = np.random.default_rng().integers(0, 100, (16, 5)).astype(np.int32)
    x = jax.device_put(rows, sharding.batch_sharding(mesh, 2))
    micro = jax.jit(lambda x: _microbatches(x, 2))(x)
    print(json.dumps(dict(
        shards=[list(s.data.shape) for s in micro.addressable_shards],
        equal=bool(np.array_equal(np.asarray(micro), np.swapaxes(rows.reshape(8, 2, 5), 0, 1))))))
""")


def test_microbatches_are_split_evenly_over_devices():
  report = run_json(_SHARDS)
  assert report["equal"]
  # 16 rows over 4 batch-parallel devices, 2 microbatches: every device holds 2 rows of each microbatch.
  assert report["shards"] == [[2, 2, 5]] * 8


def test_microbatches_that_do_not_split_over_the_devices_are_refused(data_dir):
  config = smoke_config(data_dir, batch_size=8, grad_accum_steps=4)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  check_batch_split(config.batch_size, config.grad_accum_steps, mesh)  # one device: 8 rows, 4 microbatches of 2
  mesh = type("FakeMesh", (), {"shape": {"data": 4, "fsdp": 1, "tensor": 1}})()
  with pytest.raises(ValueError, match=r"batch_size=8 .*grad_accum_steps=4 times the 4 batch-parallel"):
    check_batch_split(config.batch_size, config.grad_accum_steps, mesh)
