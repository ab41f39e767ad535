"""The paper's recipe: fine-tune Qwen3-8B into ReFusion on query/response JSON data, on a TPU pod.

    launch/tpu_pod.sh my-tpu us-central2-b configs/refusion_qwen3_8b.py gs-mounted/workdir \\
        --config.init_from=/mnt/models/Qwen3-8B \\
        --config.data.train_files=/mnt/data/refusion_train.json

(on one host: `python -m refusion_jax.train --config configs/refusion_qwen3_8b.py
--workdir DIR --config.init_from=... --config.data.train_files=...`).

Recipe: initialised from Qwen3-8B, learning rate 2e-5 with cosine decay and
no warmup, no weight decay, bfloat16 compute, sequences up to 4096 tokens,
4 epochs. Qwen3's tokenizer has no mask token, so `<|mask|>` is added as id
151669, which already fits in Qwen3-8B's 151936-row embedding: nothing is
resized. Parameters and optimizer state are sharded over all devices (FSDP).
The global batch is not fixed by the recipe notes we follow: 64 x 4096
tokens is a starting point; scale it with the pod.

Memory: check the fit before renting chips with `python -m refusion_jax.aot
--config configs/refusion_qwen3_8b.py --topology v5p:2x2x2` (and the other
topologies); `results/recipe_memory.md` holds what it measured per chip for
each variant (loss chunking, splash attention, scanned layers, remat
policies), with the commands and dates. Activations follow each chip's rows
of the batch, so memory falls as chips are added. Unrolled, the TPU compiler
schedules every layer's recomputation early and keeps the MLP activations of
many layers alive, so remat saves little; scanned, each layer is recomputed
in its turn of the backward loop (docs/method.md §5).

`init_from` and `data.train_files` are required; the checkpoint must be a
Qwen3-8B (its config.json is checked against the `qwen3_8b` preset, naming the
first field that differs). `configs/refusion_qwen3_8b.py:smoke` runs the same
path (HF init, added mask token, chat template, JSON data, FSDP, remat) for a
few short steps on any small checkpoint, e.g. Qwen3-0.6B, before a pod is paid
for.
"""

import pathlib

import ml_collections
from ml_collections import config_dict

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the recipe, "smoke" for the recipe's whole path in seconds on any small checkpoint."""
  if variant not in ("", "smoke"):
    raise ValueError(f"Unknown config variant {variant!r}; use '' or 'smoke'.")
  config = load_config(pathlib.Path(__file__).with_name("demo.py"))  # every field is documented there
  config.init_from = ""  # REQUIRED: a Qwen3-8B Hugging Face directory (config.json, safetensors, tokenizer.json)
  config.tokenizer = ""  # unused: the tokenizer comes from init_from
  config.model = ml_collections.ConfigDict()  # shapes come from init_from's config.json
  config.model.preset = "qwen3_8b"  # the architecture init_from must have (checked; "" accepts any)
  # None = the preset's 36; fewer for benchmarks and pod-fit reports (--config.model.num_layers=8)
  config.model.num_layers = config_dict.placeholder(int)
  config.model.dtype = "bfloat16"  # compute in bf16
  config.model.param_dtype = "float32"  # float32 master weights for AdamW
  config.model.remat = "full"  # 36 layers x 4096 tokens: recompute each layer in the backward pass
  config.model.attention_impl = "auto"  # splash attention on TPU, Pallas flash attention on GPU (no [T, T] scores)
  config.model.attention_chunk = 512  # query rows per chunk, if attention_impl="chunked"
  # One layer body in the compiled step. Scanned, each layer's recomputation runs inside the backward loop;
  # unrolled, the TPU compiler schedules the 36 recomputations early and keeps their MLP activations alive,
  # which on 8 chips does not fit (results/recipe_memory.md). False unrolls them, which the AOT report's
  # memory traffic column needs (the compiler counts a scanned layer once).
  config.model.scan_layers = True

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
  if variant == "smoke":
    _shrink(config)
  return config


def _shrink(config: ml_collections.ConfigDict) -> None:
  """The recipe's path (HF init, added mask token, chat template, JSON data, FSDP, remat), a few short steps."""
  config.model.preset = ""  # any small Qwen3 / Qwen2 / Llama checkpoint stands in for Qwen3-8B
  config.model.dtype = "float32"  # CPUs have no fast bfloat16
  config.objective.slot_sizes = (4, 8)
  config.data.seq_len = 128
  config.batch_size = 4
  config.num_train_steps = 4
  config.log_every = 1
  config.eval_every = 2
  config.eval.update(num_loss_batches=1, num_examples=4, batch_size=4, gen_length=16, slot_size=4, serial_blocks=1)
  config.checkpoint.every = 2
