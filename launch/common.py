"""Shared launcher plumbing: config from flags, runner selection, device setup.

A *runner* is one way of executing the train step (single device, or a
strategy twin). Every runner has the same interface, so the training loop
never knows which one it drives:

    runner.init_state(seed) -> TrainState      (created sharded, on device)
    runner.abstract_state() -> TrainState      (ShapeDtypeStructs + shardings)
    runner.place_batch(x, y) -> (x, y)         (numpy -> device arrays, per strategy)
    runner.train_step(state, x, y) -> (state, metrics)
    runner.eval_loss(params, x, y) -> loss
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from twinshard.config import Config, ModelConfig, TrainConfig, preset

STRATEGIES = ("single", "dp", "fsdp", "tp", "fsdp_tp")
IMPLS = ("auto", "manual")


def define(definer, name: str, *args, **kwargs) -> None:
    """Define a flag once per process: launchers share these, and tests import several."""
    if name not in flags.FLAGS:
        definer(name, *args, **kwargs)


def define_model_flags() -> None:
    define(flags.DEFINE_string, "preset", "small", "Named preset from twinshard.config (tiny, small, gpt2_125m, ...).")
    define(flags.DEFINE_integer, "steps", None, "Training steps (default: the preset's).")
    define(flags.DEFINE_integer, "batch_size", None, "Global batch size in sequences.")
    define(flags.DEFINE_integer, "context_length", None, "Sequence length (default: the preset's context_length).")
    define(flags.DEFINE_float, "lr", None, "Peak learning rate.")
    define(flags.DEFINE_integer, "seed", None, "Seed for init and batches.")
    define(flags.DEFINE_enum, "strategy", "single", STRATEGIES, "Parallelism strategy.")
    define(flags.DEFINE_enum, "impl", "auto", IMPLS, "auto (GSPMD annotations) or manual (shard_map collectives).")
    define(flags.DEFINE_string, "mesh", None, "Mesh, e.g. data:4,tensor:2 (default: from the device count).")
    define(flags.DEFINE_integer, "devices", 8, "Simulated CPU devices when running a strategy on CPU.")


def define_distributed_flags() -> None:
    from launch.distributed import EXIT_JOIN_FAILED, EXIT_PEER_LOST

    define(flags.DEFINE_bool, "distributed", False,
           "Join a multi-process run with jax.distributed.initialize() (auto-detected on TPU pods and "
           "SLURM; run the same command on every host).")
    define(flags.DEFINE_string, "coordinator_address", None,
           "host:port of process 0, for multi-process runs that cannot auto-detect (CPU, bare GPU hosts).")
    define(flags.DEFINE_integer, "num_processes", None, "With --coordinator_address: number of processes.")
    define(flags.DEFINE_integer, "process_id", None, "With --coordinator_address: this process's index.")
    define(flags.DEFINE_integer, "init_timeout", 300,
           "Seconds every process waits for all --num_processes to join at the coordinator; about 5 s later "
           f"it exits (code {EXIT_JOIN_FAILED}) with one line saying so.")
    define(flags.DEFINE_integer, "heartbeat_timeout", 10,
           "Seconds without a heartbeat after which a process counts as lost; every other process then "
           f"exits (code {EXIT_PEER_LOST}) with one line naming it. The coordinator's (process 0's) loss "
           "is seen at once.")


def init_distributed(FLAGS) -> None:
    """jax.distributed.initialize when asked; must run before any jax computation.

    On CPU the cross-process collectives go over gloo (measured here: 2 processes x
    4 simulated devices form one 8-device mesh). A lost peer or a run that never forms
    ends every process with one line on stderr (launch/distributed.py); the C++
    runtime's own log goes to <workdir>/logs/process<I>.log."""
    if not (FLAGS.distributed or FLAGS.coordinator_address):
        return
    from launch import distributed

    log_dir = os.path.join(getattr(FLAGS, "workdir", None) or ".", "logs")
    name = f"process{FLAGS.process_id}" if FLAGS.process_id is not None else f"pid{os.getpid()}"
    run = distributed.Run(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                          FLAGS.init_timeout, FLAGS.heartbeat_timeout, os.path.join(log_dir, name + ".log"))
    distributed.check(run)
    distributed.initialize(run, log_dir)


def define_data_flags() -> None:
    define(flags.DEFINE_string, "data", None, "UTF-8 .txt or .txt.gz corpus (default: the embedded Shakespeare).")
    define(flags.DEFINE_string, "cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "twinshard"),
            "Where tokenized corpora are cached (uint16 memmaps).")


def load_splits(cfg: Config, data_path: str | None, cache_dir: str):
    """(train, validation) token arrays of the corpus; both must hold a full window."""
    from twinshard import data

    path = data_path or data.DEFAULT_CORPUS
    tokens = data.tokenize_to_memmap(path, cfg.train.tokenizer, cache_dir)
    train, val = data.split_tokens(tokens)
    for name, part in (("training", train), ("validation", val)):
        if len(part) < cfg.model.context_length + 1:
            raise ValueError(
                f"the {name} split of {path} has {len(part)} tokens, fewer than context_length+1 = "
                f"{cfg.model.context_length + 1}; pass a smaller --context_length or a larger --data.")
    return train, val


def config_from_flags(FLAGS) -> Config:
    """The preset with flag overrides; invalid values raise ValueError here, before any work."""
    cfg = preset(FLAGS.preset)
    model: ModelConfig = cfg.model
    if FLAGS.context_length is not None:
        model = dataclasses.replace(model, context_length=FLAGS.context_length)
    overrides = {k: getattr(FLAGS, k) for k in ("steps", "batch_size", "lr", "seed")
                 if getattr(FLAGS, k) is not None}
    train: TrainConfig = cfg.train
    if overrides:
        if "lr" in overrides and overrides["lr"] <= 0:
            raise ValueError(f"--lr={overrides['lr']} must be positive.")
        if "lr" in overrides:  # keep the preset's lr/min_lr ratio
            overrides["min_lr"] = train.min_lr * overrides["lr"] / train.lr
        if "steps" in overrides:
            overrides["warmup_steps"] = min(train.warmup_steps, overrides["steps"])
        train = dataclasses.replace(train, **overrides)
    return Config(model, train)


def make_runner(strategy: str, impl: str, mesh_spec: str | None, cfg: Config, devices=None):
    """Build the runner for a strategy; validation errors are ValueErrors naming the fix.

    devices: None (all of jax.devices(), ordered by jax.make_mesh) or an explicit, ordered list."""
    from twinshard.trainer import SingleDevice

    if strategy == "single":
        return SingleDevice(cfg.model, cfg.train)
    if impl == "auto":
        from auto_parallel import make_runner as make_auto
        return make_auto(strategy, mesh_spec, cfg, devices)
    from manual_parallel import make_runner as make_manual
    return make_manual(strategy, mesh_spec, cfg, devices)


def default_platform() -> None:
    """On a machine with libtpu installed (the tpu extra) but no TPU chip or GPU, use the
    CPU without letting JAX probe libtpu (it prints TPU_WORKER_HOSTNAMES errors and
    holds /tmp/libtpu_lockfile). A set JAX_PLATFORMS, a TPU chip or a GPU: left alone."""
    from twinshard import topology

    topology.default_to_cpu()


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for n CPU devices; must run before jax initialises its backend."""
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}").strip()
