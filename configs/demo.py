"""ReFusion on the built-in tasks with a small byte-level model: trains on a laptop CPU in minutes.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo

Builds the task data under the workdir on first use, evaluates exact match and
tokens per forward on validation half way and at the end, and prints sampled
answers of the last evaluation.

Where a CPU run's time goes (2-core AMD EPYC, results/demo_seeds.md): the
training steps take nearly 90% of it; imports, building the data and
compiling the step about 5%; the first evaluation, most of it compiling the
decoder, about 5%; the last one, which reuses it, 1%. So evaluations are few
and the schedule is as long as the README's promise allows; the defaults
below are the fastest measured on a CPU (see the comments).
Override any field from the command line, e.g.
`--config.num_train_steps=200 --config.eval.num_examples=32`.

`--config configs/demo.py:smoke` shrinks everything (model, data, steps) to a
seconds-long run for tests and quick checks of the plumbing.
"""

import ml_collections

from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the demo, "smoke" for a tiny plumbing check."""
  if variant not in ("", "smoke"):
    raise ValueError(f"Unknown config variant {variant!r}; use '' or 'smoke'.")
  config = ml_collections.ConfigDict()
  config.seed = 0  # parameter init, data shuffling and objective randomness
  config.tokenizer = "bytes"  # "bytes" (pad 256, bos 257, eos 258, mask 259) or a HF tokenizer directory
  # Where a run starts: resuming from the workdir's checkpoints comes first, then this checkpoint, then a random
  # init of config.model. Any format the loaders read: a Hugging Face directory to fine-tune (config.model.preset
  # must describe it; "" accepts any), a run of ours, tunix / MaxText (root, step or item folder; they store no
  # config, so config.model and config.tokenizer must describe the model).
  config.init_from = ""
  config.init_format = "auto"  # "auto" (detect), "hf", "refusion", "tunix" or "maxtext"
  config.vocab_multiple = 128  # a vocabulary grown for a new mask token is rounded up to this

  config.model = ml_collections.ConfigDict()
  config.model.preset = "tiny"  # refusion_jax.model.config preset; the fields below override it
  config.model.vocab_size = 260  # the byte tokenizer's vocabulary
  config.model.hidden_size = 128  # residual width
  config.model.intermediate_size = 384  # SwiGLU width
  config.model.num_layers = 4  # decoder layers
  config.model.num_heads = 4  # query heads
  config.model.num_kv_heads = 2  # key/value heads (GQA)
  config.model.head_dim = 32  # per-head width
  config.model.dtype = "float32"  # activation dtype ("bfloat16" on accelerators)
  config.model.param_dtype = "float32"  # parameter dtype
  config.model.remat = "none"  # kept for the backward pass: "none", "full", "projections", "projections_except_mlp"
  # "auto" (fused kernel for training on TPU/GPU, else "xla"), "flash", "xla", "chunked" (query chunks), "dot_product"
  # On a CPU "auto" runs "xla", the fastest demo step measured ("dot_product" 3% slower, interleaved rounds).
  config.model.attention_impl = "auto"
  config.model.attention_chunk = 512  # query rows per chunk of "chunked"
  # Run the layers as one lax.scan (same results). Off here: on a CPU the demo's scanned step ran 13% slower and
  # compiled no faster (4 layers).
  config.model.scan_layers = False

  config.objective = ml_collections.ConfigDict()
  config.objective.kind = "refusion"  # "refusion", "ar" or "mdm"
  config.objective.slot_sizes = (4, 8)  # slot sizes drawn per example (the paper: 4, 8, 16, 32)
  config.objective.eps = 1e-3  # masking probability p = (1 - eps) t + eps
  # Loss: logits of this many tokens of length at a time (0 = all at once). Rows of seq_len <= 256 tokens take the
  # dense path anyway, so the demo pays nothing for chunking.
  config.objective.loss_chunk = 256

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "tasks"  # "tasks" (built-in, generated) or "json" (query/response files)
  config.data.data_dir = ""  # where the tfds data is built; "" = <workdir>/data
  config.data.num_train = 20_000  # built-in tasks: training examples
  config.data.num_validation = 1_000  # built-in tasks: validation examples
  config.data.num_test = 1_000  # built-in tasks: test examples
  config.data.seed = 0  # built-in tasks: generation seed
  # built-in tasks to use (all: copy reverse sort add add_steps lookup code); these three have
  # answers whose slots can be filled out of order, and this model learns them in minutes
  config.data.tasks = ("sort", "lookup", "code")
  config.data.train_files = ""  # json: comma-separated training files
  config.data.validation_files = ""  # json: comma-separated validation files
  config.data.seq_len = 64  # prompt + answer + EOS (the built-in tasks need <= 63); longer examples are dropped
  config.data.chat_template = False  # wrap queries in the tokenizer's chat template
  # Pack several examples per row (training and validation loss; not for "mdm"): 1.37 examples per row, so each
  # step sees 37% more examples than one per row, for ~5% more time per step on a 2-core CPU: the compiled step
  # +2% (interleaved rounds, within the noise) and packing on the host 18 ms of CPU per batch against 8 ms (a
  # step is ~310 ms of CPU): what a packed step costs more than an unpacked one; no other default is faster.
  config.data.packing = True
  config.data.max_segments = 16  # packing: most examples in one row
  config.data.warn_drop_fraction = 0.1  # warn once when a pass drops more than this share as too long

  config.batch_size = 32  # global batch (all processes)
  config.grad_accum_steps = 1  # microbatches per step (lax.scan inside the step)
  # Optimizer updates; <= 0 means num_epochs passes over the data. The steps are most of the demo's time: 1,000
  # (2.2 passes over the 20,000 training examples) take about 4 minutes on an idle 2-core CPU, 5 with the install;
  # 800 took 20% less time but reached 40.4% exact match where 1,000 reach 45.8% (3 seeds, results/demo_seeds.md),
  # and a higher learning rate did not make up for the shorter schedule (3e-3: 36%, 5e-3: 41% at 800 steps, seed 0).
  config.num_train_steps = 1000
  config.num_epochs = 1  # used only when num_train_steps <= 0
  config.stop_after_step = -1  # save and stop at this step while keeping the schedule of num_train_steps
  config.stop_grace_s = 10.0  # after SIGTERM/SIGINT, seconds to reach a point where it can save; then exit

  # Pod faults (training/faults.py, docs/scaling.md "When a host is lost or stalls"): a lost or stalled process ends
  # every process that can still act, with one line and exit status 75, on which launch/*.sh restart the job.
  config.faults = ml_collections.ConfigDict()
  config.faults.heartbeat_timeout_s = 10.0  # a process silent this long is lost (JAX's own abort gets 50 s)
  # A train step not done in this long ends the run (0: off). Compiling, evaluating and saving do not count; 300 s
  # is far above any healthy step of the recipes (the 8B recipe's step takes seconds) and its data fetch.
  config.faults.step_timeout_s = 300.0
  # The start of a run (building or opening the data, restoring, compiling the first step) not done in this long
  # ends it (0: off). An hour leaves ample room for restoring and compiling a large model; raise it where the data
  # is built from a large corpus at the start (that is timed too).
  config.faults.startup_timeout_s = 3600.0
  config.faults.initialization_timeout_s = 300  # jax.distributed: how long processes wait for each other to join
  config.faults.shutdown_timeout_s = 300  # jax.distributed: how long a finished process waits for the others

  # LoRA (refusion_jax.model.lora): train low-rank adapters on frozen kernels; rank 0 trains every weight.
  config.lora = ml_collections.ConfigDict()
  config.lora.rank = 0  # adapter rank r (0: off, full fine-tuning)
  config.lora.alpha = 16.0  # scale = alpha / r (peft's lora_alpha)
  config.lora.dropout = 0.0  # dropout on the adapters' inputs while training (peft's lora_dropout)
  config.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # also gate_proj, up_proj, down_proj
  config.lora.use_rslora = False  # scale = alpha / sqrt(r) instead
  # QLoRA (refusion_jax.model.quant): "int8" or "int4" freezes the base's projections as integers under the float32
  # adapters (needs lora.rank > 0); the base is quantized while it is loaded. "none": the base as loaded.
  config.quantize = "none"
  config.quantize_group_size = 128  # int4: inputs per scale (0: one scale per output channel)

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.lr = 2e-3  # peak learning rate
  config.optimizer.warmup_steps = 100  # linear warmup from 0
  config.optimizer.decay = "cosine"  # "cosine", "linear" or "constant" after warmup
  config.optimizer.final_lr_ratio = 0.1  # final lr = lr * this
  config.optimizer.weight_decay = 0.01  # AdamW decoupled weight decay (matrices only)
  config.optimizer.b1 = 0.9  # Adam first-moment decay
  config.optimizer.b2 = 0.98  # Adam second-moment decay
  config.optimizer.eps = 1e-8  # Adam epsilon
  config.optimizer.grad_clip = 1.0  # global-norm gradient clipping

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # data-parallel ways (-1: all remaining devices)
  config.mesh.fsdp = 1  # parameter-sharded data-parallel ways
  config.mesh.tensor = 1  # tensor-parallel ways
  config.sharding_rules = LOGICAL_AXIS_RULES  # logical axis -> mesh axes

  config.log_every = 50  # steps between console / TensorBoard training lines
  config.eval_every = 500  # steps between evaluations (and at the end); <= 0 disables
  config.num_samples_to_print = 8  # decoded validation answers shown after training

  config.eval = ml_collections.ConfigDict()
  config.eval.num_loss_batches = 4  # validation batches for the loss
  config.eval.num_examples = 128  # validation examples decoded for exact match
  config.eval.batch_size = 64  # prompts decoded together
  config.eval.gen_length = 48  # answer budget G (responses are <= 42 bytes + EOS)
  config.eval.slot_size = 8  # ReFusion slot size S at decoding
  config.eval.serial_blocks = 1  # ReFusion serial blocks NB (G must divide by S * NB)
  config.eval.slot_threshold = 0.9  # ReFusion: plan slots with first-token confidence above this
  config.eval.token_threshold = 0.5  # ReFusion: verified tokens need AR probability above this
  config.eval.mdm_block_length = 16  # MDM baseline: semi-autoregressive block length (divides gen_length)
  config.eval.mdm_steps = 48  # MDM baseline: total unmasking steps (one token per step over G = 48)

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every = 500  # steps between checkpoints (and at the end / on SIGTERM)
  config.checkpoint.max_to_keep = 2  # older checkpoints are deleted
  config.checkpoint.async_save = True  # write files in the background
  config.checkpoint.on_corrupt = "fallback"  # unreadable newest step: "fallback" (set aside, resume before) or "fail"
  if variant == "smoke":
    _shrink(config)
  return config


def _shrink(config: ml_collections.ConfigDict) -> None:
  """A model, data set and schedule small enough to train and evaluate in seconds."""
  config.model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
  config.data.update(num_train=256, num_validation=32, num_test=8)
  config.batch_size = 8
  config.num_train_steps = 4
  config.optimizer.warmup_steps = 1
  config.log_every = 1
  config.eval_every = 2
  config.eval.update(num_loss_batches=1, num_examples=8, batch_size=8, gen_length=16, slot_size=4)
  config.eval.update(mdm_block_length=16, mdm_steps=8)
  config.checkpoint.every = 2
