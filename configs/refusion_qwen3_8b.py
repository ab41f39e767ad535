"""The paper's recipe: fine-tune Qwen3-8B into ReFusion on query/response JSON data, on a TPU pod.

    launch/tpu_pod.sh my-tpu us-central2-b configs/refusion_qwen3_8b.py gs-mounted/workdir \\
        --config.init_from_hf=/mnt/models/Qwen3-8B \\
        --config.data.train_files=/mnt/data/refusion_train.json

(on one host: `python -m refusion_jax.train --config configs/refusion_qwen3_8b.py
--workdir DIR --config.init_from_hf=... --config.data.train_files=...`).

Recipe: initialised from Qwen3-8B, learning rate 2e-5 with cosine decay and
no warmup, no weight decay, bfloat16 compute, sequences up to 4096 tokens,
4 epochs. Qwen3's tokenizer has no mask token, so `<|mask|>` is added as id
151669, which already fits in Qwen3-8B's 151936-row embedding: nothing is
resized. Parameters and optimizer state are sharded over all devices (FSDP).
The global batch is not fixed by the recipe notes we follow: 64 x 4096
tokens is a starting point; scale it with the pod.
"""

import importlib.util
import os

import ml_collections


def _demo_config() -> ml_collections.ConfigDict:
  # Config files are loaded by path, not as a package: load the demo the same way.
  spec = importlib.util.spec_from_file_location("demo_config", os.path.join(os.path.dirname(__file__), "demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config() -> ml_collections.ConfigDict:
  config = _demo_config()  # every field is documented there; the recipe changes these
  config.init_from_hf = ""  # REQUIRED: a Qwen3-8B Hugging Face directory (config.json, safetensors, tokenizer.json)
  config.tokenizer = ""  # unused: the tokenizer comes from init_from_hf
  config.model = ml_collections.ConfigDict()  # shapes come from init_from_hf's config.json
  config.model.preset = "qwen3_8b"  # the architecture the checkpoint must have
  config.model.dtype = "bfloat16"  # compute in bf16
  config.model.param_dtype = "float32"  # float32 master weights for AdamW
  config.model.remat = True  # 36 layers x 4096 tokens: recompute activations in the backward pass

  config.objective.slot_sizes = (4, 8, 16, 32)  # the paper's slot sizes

  config.data.dataset = "json"  # query/response JSON (the released ReFusion data format)
  config.data.train_files = ""  # REQUIRED: comma-separated training JSON files
  config.data.validation_files = ""  # optional held-out JSON files (no periodic eval without them)
  config.data.seq_len = 4096  # maximum prompt + answer length; longer examples are dropped
  config.data.chat_template = True  # queries wrapped in Qwen's ChatML user turn

  config.batch_size = 64  # global sequences per step
  config.grad_accum_steps = 1  # raise to fit memory at a fixed global batch
  config.num_train_steps = -1  # derived from num_epochs
  config.num_epochs = 4  # passes over the training data

  config.optimizer.lr = 2e-5  # peak (= initial, no warmup) learning rate
  config.optimizer.warmup_steps = 0  # no warmup
  config.optimizer.decay = "cosine"  # cosine decay over the run
  config.optimizer.final_lr_ratio = 0.0  # decays to zero
  config.optimizer.weight_decay = 0.0  # no weight decay
  config.optimizer.b2 = 0.999  # Adam default second-moment decay

  config.mesh.data = 1  # no pure data parallelism ...
  config.mesh.fsdp = -1  # ... parameters and optimizer state sharded over every device
  config.mesh.tensor = 1  # no tensor parallelism

  config.log_every = 10  # steps between log lines
  config.eval_every = 500  # steps between evaluations (needs validation_files)
  config.num_samples_to_print = 4  # decoded validation answers shown after training
  config.eval.num_loss_batches = 8  # validation batches for the loss
  config.eval.num_examples = 64  # validation examples decoded for exact match
  config.eval.batch_size = 8  # prompts decoded together
  config.eval.gen_length = 512  # answer budget G
  config.eval.slot_size = 8  # slot size S at decoding
  config.eval.serial_blocks = 4  # serial blocks NB
  config.eval.slot_threshold = 0.9  # plan threshold
  config.eval.token_threshold = 0.9  # verification threshold

  config.checkpoint.every = 500  # steps between checkpoints (and on SIGTERM / preemption)
  config.checkpoint.max_to_keep = 3  # older checkpoints are deleted
  return config
