"""train(cfg): compose objects from the Hydra config, fit, export the EMA weights, return val/loss.

Before anything is written, the run claims its folder (ddpm.run_dir: never into another run's results); after
fit, a run that took no optimizer step fails instead of exporting untrained weights as a success.
"""

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import get_class
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from ddpm import distributed
from ddpm.callbacks.ema import EMA
from ddpm.callbacks.last_checkpoint import LastCheckpoint
from ddpm.callbacks.preemption import Preemption
from ddpm.callbacks.rng import RNGState
from ddpm.config import build, validate_config
from ddpm.config.entries import TrainKeys
from ddpm.data.latents import TARGET as LATENT_DATA  # data=latents: a run on a VAE's latents
from ddpm.data.latents import check_decoder_folder, latent_record
from ddpm.distributed import RestoreCollectiveTimeout, bound_join, explain_join_failure
from ddpm.job_end import WANDB_RUN_KEY, KeepWandbRun, finished, recorded
from ddpm.logs import say
from ddpm.memory import explain_oom
from ddpm.objective import check_objective, objective_value
from ddpm.precision import (
    check_fp16_device,
    compile_note,
    configure_precision,
    precision_note,
    resolve_compile,
    resolve_precision,
)
from ddpm.ranks import first_process
from ddpm.resume import (
    check_resume,
    checkpoint_world,
    load_training_checkpoint,
    record_world,
    requeued_from,
    resolve_ckpt_path,
    world_of,
)
from ddpm.run_checks import check_agreement
from ddpm.run_dir import claim_run, holding, inside
from ddpm.sweep import continue_wandb_run, name_wandb_run
from ddpm.tuning import run_tuning
from ddpm.weights.init import load_init
from ddpm.weights.lightning_io import AtomicCheckpointIO
from ddpm.weights.safetensors_file import save_ema_safetensors
from ddpm.weights.torch_file import export_ema


class NoTrainingStep(RuntimeError):
    """fit() ended without a single optimizer step although the config asked for training."""


def build_callbacks(cfg: DictConfig) -> tuple[EMA, list[pl.Callback]]:
    """The EMA callback first (grids and checkpoints then see this step's average), the RNG states, then the others,
    Preemption and LastCheckpoint last: their checkpoints hold what every other callback did at that step (the NaN
    guard's loss)."""
    ema = build(cfg.ema)
    nodes = [node for node in (cfg.get("callbacks") or {}).values() if node is not None]
    others = [build(node, **checkpoint_options(node)) for node in nodes]
    others.sort(key=lambda callback: isinstance(callback, Preemption))
    for preemption in [callback for callback in others if isinstance(callback, Preemption)]:
        preemption.requeue_on = distributed.requeue_signal(requeue=cfg.get("slurm_requeue", True))  # then requeue
    return ema, [ema, RNGState(seed=cfg.get("seed")), *others, LastCheckpoint()]  # RNGState: before every save


def checkpoint_options(node: Any) -> dict[str, Any]:
    """What train.py adds to a ModelCheckpoint: it overwrites its own names (last.ckpt, step_*.ckpt) instead of adding
    last-v1.ckpt (files already there are this run's own, resumed in place: ddpm.run_dir refuses or moves any other
    run's); monitoring `step` (or nothing) with save_on_train_epoch_end unset, a save due on an epoch's last batch is
    written at its step (Lightning holds it until the next validation, which with trainer.val_check_interval counted
    across epochs may be thousands of steps away); a validation metric keeps Lightning's rule (saved at validation,
    where the metric is)."""
    target = node.get("_target_") if hasattr(node, "get") else None
    try:
        is_checkpoint = isinstance(target, str) and issubclass(get_class(target), ModelCheckpoint)
    except (ImportError, ValueError, TypeError):
        is_checkpoint = False
    if not is_checkpoint:
        return {}
    at_its_step = node.get("save_on_train_epoch_end") is None and node.get("monitor") in (None, "step")
    return {"enable_version_counter": False, **({"save_on_train_epoch_end": True} if at_its_step else {})}


def check_validation_schedule(trainer: dict[str, Any]) -> None:
    """A fractional trainer.val_check_interval (of an epoch) needs validation tied to epochs; with the default
    check_val_every_n_epoch=null Lightning refuses it, naming neither fix."""
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and trainer.get("check_val_every_n_epoch") is None:
        raise ValueError(
            f"trainer.val_check_interval={interval} is a fraction of an epoch, which needs validation at epoch ends "
            f"(trainer.check_val_every_n_epoch=1); with check_val_every_n_epoch=null (the default) give a number of "
            f"training batches across epochs, e.g. trainer.val_check_interval=500"
        )


def checkpoint_dirs(resolved: dict[str, Any]) -> list[Path]:
    """The dirpath of every ModelCheckpoint in the config (they may lie outside the run folder)."""
    nodes = (resolved.get("callbacks") or {}).values()
    return [Path(n["dirpath"]) for n in nodes if isinstance(n, dict) and n.get("dirpath") and checkpoint_options(n)]


def keep_metrics_history(loggers: list[Any] | bool) -> None:
    """Lightning's CSVLogger deletes an existing metrics.csv when it starts; a resume in place keeps the old one
    under another name (metrics-<time>.csv)."""
    for logger in loggers or []:
        old = Path(logger.log_dir) / "metrics.csv" if isinstance(logger, CSVLogger) else None
        if old is not None and old.is_file():
            old.rename(old.with_name(f"metrics-{time.strftime('%Y%m%d-%H%M%S')}.csv"))


def build_loggers(cfg: DictConfig) -> list[Any] | bool:
    loggers = [build(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    return loggers or False


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as plain data, with every `auto` the project decides already decided
    (trainer.precision: bf16-mixed or 32-true; compile: true or false, for this device), every key checked
    (ddpm.config.validate: types, unknown keys; whole-number floats become ints in `cfg` too)."""
    resolved = validate_config(cfg, entry="train", decided=auto_decisions(cfg))
    check_agreement(resolved)  # keys that must agree with each other
    return resolved


def auto_decisions(cfg: DictConfig) -> dict[str, Any]:
    """{key: decided value} for the `auto` settings: trainer.precision and compile (a wrong word fails here,
    naming its key)."""
    accelerator = OmegaConf.select(cfg, "trainer.accelerator")
    decided: dict[str, Any] = {}
    precision = OmegaConf.select(cfg, "trainer.precision")
    if precision is not None:
        decided["trainer.precision"] = resolve_precision(precision, accelerator)
        check_fp16_device(precision, accelerator)
    for key in ("compile", "module.compile"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str):
            decided[key] = resolve_compile(value, accelerator)
    return decided


def with_latent(resolved: dict[str, Any]) -> dict[str, Any]:
    """The run config with its `latent` record when it trains on latents (ddpm.data.latents.latent_record: the VAE
    and the scaling sample.py, the grids and FID decode with), read from the encoded folder's meta.json."""
    if (resolved.get("data") or {}).get("_target_") != LATENT_DATA:
        return resolved
    record = latent_record(resolved["data"])
    check_decoder_folder(record, resolved.get("callbacks") or {})
    return resolved | {"latent": record}


@holding()
def train(cfg: DictConfig) -> float | None:
    """Fit the configured model; returns the final value of `cfg.objective` (val/loss by default), or None."""
    name_wandb_run(cfg)  # logger.wandb name and group from the Hydra overrides and sweep dir, where null
    resolved = with_latent(resolve_config(cfg))  # fail fast, before the LR range test too
    keys = TrainKeys.of(resolved)  # the entry point's own keys, typed (ddpm.config.entries)
    check_objective(resolved)  # a metric the run logs, before any step (objective_value checks again after fit)
    check_validation_schedule(resolved.get("trainer") or {})
    distributed.check_requeue(
        requeue=keys.slurm_requeue, preemption=(resolved.get("callbacks") or {}).get("preemption")
    )
    output_dir = Path(cfg.paths.output_dir)
    ckpt_path = resolve_ckpt_path(keys.ckpt_path, resume_dir=keys.resume_dir, output_dir=output_dir)
    ckpt_path = requeued_from(output_dir, ckpt_path, checkpoint_dirs(resolved))  # a requeued SLURM job: in place
    claim_run(output_dir, ckpt_path=ckpt_path, overwrite=keys.overwrite,
              checkpoint_dirs=checkpoint_dirs(resolved))  # fmt: skip
    if keys.tune is not None:
        if not run_tuning(cfg, resolved):
            return None  # tune=lr_find without tune.apply=true: the plot and the suggestion are the result
        resolved = with_latent(resolve_config(cfg))  # again: tune.apply set optim.lr
    if keys.seed is not None:
        pl.seed_everything(keys.seed, workers=True)
    if str(cfg.get("compile")).lower() == "auto" and first_process():
        say(compile_note(keys.compile, OmegaConf.select(cfg, "trainer.accelerator")))
    if str(OmegaConf.select(cfg, "trainer.precision")) == "auto" and first_process():
        say(precision_note(resolved["trainer"]["precision"], OmegaConf.select(cfg, "trainer.accelerator")))
    precision = resolved.get("trainer", {}).get("precision")
    start_step, before, wandb_run = 0, None, None
    if ckpt_path is not None:  # refusals first: a refused resume writes nothing into the run folder
        checkpoint = load_training_checkpoint(ckpt_path)
        check_steps_left(ckpt_path, int(checkpoint["global_step"]), resolved.get("trainer", {}).get("max_steps", -1),
                         vae=resolved["module"]["_target_"] == "ddpm.vae_module.VAEModule")  # fmt: skip
        check_resume(ckpt_path, resolved, output_dir, checkpoint=checkpoint, write=first_process())  # breaking changes
        start_step, before = int(checkpoint["global_step"]), checkpoint_world(checkpoint)
        wandb_run = checkpoint.get(WANDB_RUN_KEY)
        del checkpoint
    continue_wandb_run(cfg, wandb_run, in_place=inside(ckpt_path, output_dir))  # a requeue continues its W&B run
    with recorded(output_dir, keys.objective):  # result.json: RUNNING until the job ends (after the refusals)
        net = build(cfg.model)
        if keys.init_from and ckpt_path is None:  # fine-tune: weights only; a resume restores its own
            load_init(keys.init_from, net, resolved["model"])  # CheckpointError naming the model.* keys that differ
            if first_process():
                say(f"init_from: the weights of {keys.init_from} (a fresh optimizer and schedule)")
        output_dir.mkdir(parents=True, exist_ok=True)
        if first_process():
            OmegaConf.save(OmegaConf.create(resolved), output_dir / "config.yaml")

        datamodule = build(cfg.data)
        optim = build(cfg.optim)
        parts = {"diffusion": build(cfg.diffusion)} if cfg.get("diffusion") is not None else {}  # none: module=vae
        # A partial, called here: run_config's `_target_` nodes must stay plain data (a dict in the checkpoint).
        # A partial, called with module.compile as decided (auto resolved above)
        module = build(cfg.module, _partial_=True)(net=net, **parts, optim=optim, run_config=resolved,
                                                         compile=resolved["module"]["compile"])  # fmt: skip
        ema, callbacks = build_callbacks(cfg)
        configure_precision(precision)  # fp16 warning; TF32 on Ampere+ for float32
        loggers = build_loggers(cfg)
        trainer: pl.Trainer = build(
            cfg.trainer,
            precision=precision,
            callbacks=[*callbacks, RestoreCollectiveTimeout(), KeepWandbRun()],  # dist_timeout_s after the join
            logger=loggers,
            default_root_dir=str(output_dir),
            plugins=[AtomicCheckpointIO(), *distributed.slurm_plugins()],
        )
        timeout = keys.dist_timeout_s
        bound_join(trainer, timeout)
        if first_process():
            keep_metrics_history(loggers)
            if before is not None:  # world size, global batch and LR before/after, in resume_diff.yaml
                batch = getattr(datamodule, "batch_size", 0)
                record_world(output_dir, before, world_of(trainer, batch, optim.scaled_lr))
        joining = explain_join_failure(world_size=trainer.world_size, num_nodes=trainer.num_nodes, seconds=timeout)
        with finished(trainer.loggers):  # W&B finishes with the job's outcome
            with explain_oom(batch_size=cfg.data.get("batch_size"), precision=precision), joining:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            check_trained(trainer, start_step)  # before anything is exported
            if trainer.is_global_zero and ema.shadow is not None and hasattr(module, "write_exports"):
                module.write_exports(output_dir, ema)  # a module with its own exports (ddpm.vae_module: <run>/vae/)
            elif trainer.is_global_zero and ema.shadow is not None:
                path = export_ema(output_dir / "ema.pt", ema.shadow, resolved)
                safe = save_ema_safetensors(output_dir / "ema.safetensors", ema.shadow, resolved)  # unpickle-free
                say(f"EMA weights: {path} (and {safe.name})")
            value = objective_value(trainer, keys.objective)
        return value


def check_steps_left(ckpt_path: Path, step: int, max_steps: int, *, vae: bool = False) -> None:
    """A resume from a checkpoint at or past trainer.max_steps would train nothing: refused up front."""
    if max_steps is not None and max_steps >= 0 and step >= max_steps:
        kept = (f"a VAE run writes its <run>/vae/ folder when a fit ends: without one (a run stopped while writing "
                f"it), trainer.max_steps={step + 1} trains one step and writes it" if vae else "its EMA weights are "
                "in its ema.pt and the checkpoint: sample.py and python -m ddpm.export read either")  # fmt: skip
        raise NoTrainingStep(
            f"ckpt_path={ckpt_path} is at step {step} and trainer.max_steps={max_steps}: nothing is left to train; "
            f"raise trainer.max_steps (e.g. trainer.max_steps={step + max(step, 1)}) to continue the run ({kept})"
        )


def check_trained(trainer: pl.Trainer, start_step: int) -> None:
    """Fail a fit that asked for training but took no optimizer step (the guard of last resort: the datamodules
    check their batches up front), so no untrained ema.pt is exported and the run is not reported a success."""
    asked = trainer.max_steps != 0 and trainer.max_epochs != 0 and trainer.limit_train_batches != 0
    if trainer.global_step > start_step or not asked:
        return
    batches = trainer.num_training_batches
    loader = trainer.train_dataloader
    size = len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else "?"
    if trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
        cause = (f"the run was already at epoch {trainer.current_epoch} of trainer.max_epochs={trainer.max_epochs}; "
                 "raise trainer.max_epochs (or set trainer.max_steps with trainer.max_epochs=-1)")  # fmt: skip
    elif batches == 0:
        cause = (f"the training data gave no batch: {size} training samples over {trainer.world_size} process(es) "
                 f"leave each fewer than data.batch_size={getattr(loader, 'batch_size', '?')} (the last partial "
                 "batch is dropped); lower data.batch_size, use more data (data.limit) or fewer processes")  # fmt: skip
    else:
        cause = (f"the data gave {batches} batch(es) per process, but fitting stopped before the first optimizer "
                 f"step (trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}; a callback, a signal or "
                 "trainer.max_time stopped it: see the log above)")  # fmt: skip
    raise NoTrainingStep(
        f"the run took no optimizer step (global step {trainer.global_step}, trainer.max_steps={trainer.max_steps}, "
        f"trainer.max_epochs={trainer.max_epochs}): {cause}. Nothing was exported (no ema.pt, ema.safetensors)"
    )
