"""DiffusionModule: the LightningModule that owns the UNet, the schedule and the optimizer settings.

`compile` compiles the training loss as one graph: q_sample (or EDM's scaling), the network and the weighted MSE,
forward and backward (`torch.compile` of a function, so the network's parameter names, in checkpoints and the EMA,
stay plain). The random draws of the step (timesteps, noise, label dropout) stay outside it, in eager torch, so a
compiled run draws the same numbers as an eager one. Validation and the sample grids call the network eagerly: a
second graph (eval mode, no gradients, other batch sizes) would cost another cold compile for a few calls. With a
CUDA-graph mode (`reduce-overhead`, `max-autotune`) each step marks a new CUDA-graph iteration.
"""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from ddpm.callbacks.monitor import logs_this_step
from ddpm.diffusion.edm import EDMDiffusion
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.distributed import keep_buffers_local
from ddpm.epoch_mean import EpochMeans
from ddpm.logs import say
from ddpm.models.unet import UNet
from ddpm.models.vae import is_autoencoder
from ddpm.optim import AdamW
from ddpm.precision import CompileMode, compile_mode, resolve_compile, uses_cudagraphs

Batch = tuple[Tensor, Tensor]  # images (B, C, H, W) float in [-1, 1], labels (B,) int64


class DiffusionModule(pl.LightningModule):
    """Trains `net` with `diffusion.loss`; validation loss at fixed timesteps and noise (EMA weights)."""

    LOGGED_METRICS = ("val/loss", "train/loss")  # what an objective may name (ddpm.objective)

    def __init__(
        self,
        *,
        net: UNet,  # the denoising network
        diffusion: GaussianDiffusion | EDMDiffusion | None = None,  # schedule and objective (DDPM family or EDM)
        optim: AdamW,  # optimizer and LR schedule settings
        compile: bool | CompileMode | Literal["auto"] = False,  # torch.compile the loss: false, true, auto or a mode
        compile_backend: str = "inductor",  # torch.compile backend (tests use "eager" / "aot_eager")
        channels_last: bool = False,  # NHWC weights and inputs (slower to train on an H100 and on CPUs: measured)
        val_timesteps: int = 10,  # size of the fixed timestep grid of val/loss
        val_seed: int = 1234,  # seed of the fixed validation noise
        run_config: dict[str, Any] | None = None,  # resolved run config, stored so sample.py can rebuild
    ) -> None:
        super().__init__()
        if diffusion is None or is_autoencoder(net):  # a VAE config's parts
            raise ValueError(
                f"module=diffusion trains a denoising network with a diffusion node; this config has model "
                f"{type(net).__name__} and diffusion {type(diffusion).__name__}: train a VAE with module=vae "
                "(experiment=mnist_vae), a diffusion model with model=unet_mnist diffusion=linear"
            )
        if val_timesteps < 1:
            raise ValueError(f"module.val_timesteps={val_timesteps} must be >= 1")
        self.net, self.diffusion, self.optim = net, diffusion, optim
        self.compile_mode, self.val_seed = compile_mode(resolve_compile(compile)), val_seed  # None: eager
        self.compile_backend, self.channels_last = compile_backend, channels_last
        grid = torch.linspace(0, diffusion.num_timesteps - 1, val_timesteps).round().long()
        self.register_buffer("val_grid", grid, persistent=False)  # (K,) timesteps of val/loss
        # Labels outside 0..num_classes-1 seen so far: count, smallest, largest (on the device: no sync per step).
        self.register_buffer("bad_labels", torch.tensor([0, 2**62, -(2**62)]), persistent=False)
        self.save_hyperparameters({"config": run_config or {}})
        self._checked = {"train": False, "val": False}
        self.val_means = EpochMeans(("val/loss",))
        keep_buffers_local(self)
        self._loss_fn = self._loss  # the compiled loss after configure_model, when compile is set

    def configure_model(self) -> None:
        if self.channels_last:
            self.net.to(memory_format=torch.channels_last)
        if self.compile_mode is not None and self._loss_fn == self._loss:
            inductor = self.compile_backend == "inductor"  # modes are inductor's
            self._loss_fn = torch.compile(self._loss, backend=self.compile_backend, dynamic=False,
                                          mode=self.compile_mode if inductor else None)  # fmt: skip

    def _loss(self, x0: Tensor, t: Tensor, noise: Tensor, y: Tensor | None) -> Tensor:
        """The training loss of one batch (the function `compile` compiles): a float32 scalar."""
        return self.diffusion.loss(self.net, x0, t, noise, y)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        return self.net(x, t, y)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x0, y = self._checked_batch(batch, "train")
        t = self.diffusion.sample_timesteps(x0.shape[0], x0.device)
        noise, labels = torch.randn_like(x0), self._training_labels(y)
        if uses_cudagraphs(self.compile_mode):
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be reused
        loss = self._loss_fn(x0, t, noise, labels)
        if logs_this_step(self._trainer):  # the loggers' rows are the same; the other steps skip self.log's cost
            self.log("train/loss", loss)  # not prog_bar: Lightning reads those every step (a host sync)
            self.check_labels_seen()  # this step syncs anyway
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x0, y = self._checked_batch(batch, "val")
        index = batch_idx * x0.shape[0] + torch.arange(x0.shape[0], device=x0.device)
        t = self.val_grid[index % len(self.val_grid)]
        generator = torch.Generator().manual_seed(self.val_seed + batch_idx)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device)
        loss = self.diffusion.loss(self.net, x0, t, noise, self._valid_labels(y))
        self.val_means.add((loss,), x0.shape[0])  # logged at the epoch's end, by every process (ddpm.epoch_mean)
        return loss

    def _training_labels(self, y: Tensor) -> Tensor | None:
        valid = self._valid_labels(y)
        return None if valid is None else self.diffusion.drop_labels(valid, null_class=self.net.num_classes)

    def _valid_labels(self, y: Tensor) -> Tensor | None:
        """Labels in 0..num_classes-1 pass; any other is recorded (`bad_labels`, on the device) and replaced by the
        null class, so that an embedding never reads outside its table (a device-side assert on CUDA) before the
        next check (`check_labels_seen`) stops the run. None for an unconditional model."""
        classes = self.net.num_classes
        if classes is None:
            return None
        valid = (y >= 0) & (y < classes)
        seen = torch.stack([(~valid).sum(), y.min(), y.max()])
        bad = self.bad_labels
        bad.copy_(torch.stack([bad[0] + seen[0], torch.minimum(bad[1], seen[1]), torch.maximum(bad[2], seen[2])]))
        return torch.where(valid, y, classes)

    def check_labels_seen(self) -> None:
        """Stop the run if a batch since the start held a label outside 0..num_classes-1 (one host sync: called at
        logged steps, before a checkpoint is written and at the end of training and validation); every process
        reads every process's record (each keeps its own: distributed.keep_buffers_local): all stop together."""
        seen = self.bad_labels
        if self._trainer is not None and self.trainer.world_size > 1:
            every = self.all_gather(seen).reshape(-1, 3)  # (world_size, 3)
            seen = torch.stack([every[:, 0].sum(), every[:, 1].min(), every[:, 2].max()])
        count, low, high = seen.tolist()
        if count:
            raise ValueError(label_error(f"{count} label(s) in the training or validation batches", low, high,
                                         self.net.num_classes))  # fmt: skip

    def _checked_batch(self, batch: Batch, split: str) -> Batch:
        if not self._checked[split]:
            check_batch(batch, self.net, latent=bool(self.hparams.get("config", {}).get("latent")))
            self._checked[split] = True
        if self.channels_last:
            return batch[0].contiguous(memory_format=torch.channels_last), batch[1]
        return batch

    def global_batch_size(self) -> int:
        """Batch size x devices x nodes x accumulation: what the LR scaling rule sees."""
        per_device = getattr(self.trainer.datamodule, "batch_size", self.optim.base_batch_size)
        return per_device * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self) -> dict[str, Any]:
        global_batch = self.global_batch_size()
        optimizer, schedule = self.optim.build(
            list(self.net.parameters()), global_batch_size=global_batch, total_steps=self.trainer.max_steps
        )
        self.scaled_lr = self.optim.scaled_lr(global_batch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step, with the gradients unscaled under 16-mixed right after the backward: Lightning leaves
        them scaled for a fused optimizer (ours, see ddpm.optim), whose kernel unscales inside the update, so the
        guard's and the monitor's gradient norm read scale x the norm and clipping cut the true norm to
        clip / scale (65536 at the start). Unscaled here, GradScaler.step hands the fused kernel only `found_inf`."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is None or optimizer_closure is None:
            return pl.LightningModule.optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure)
        raw = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper: the scaler keys the torch optimizer

        def closure_then_unscale() -> Any:
            result = optimizer_closure()
            if result is not None and getattr(raw, "_step_supports_amp_scaling", False):
                scaler.unscale_(raw)  # once per step: after the last micro-batch's backward
            return result

        return pl.LightningModule.optimizer_step(self, epoch, batch_idx, optimizer, closure_then_unscale)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """trainer.gradient_clip_val, applied here (foreach kernels, no host sync): Lightning's mixed-precision
        plugin refuses to clip for a fused optimizer (ours, see ddpm.optim), although by this hook the gradients
        are unscaled under 16-mixed too (optimizer_step). The global norm that NaNGuard computed of these same
        gradients just before (`optimizer.grad_norm`) is reused, not computed again."""
        norm = vars(optimizer).pop("grad_norm", None)  # this step's, set by NaNGuard.on_before_optimizer_step
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not gradient_clip_val or not params:
            return
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val, foreach=True)
        elif norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm, foreach=True)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)

    def on_train_start(self) -> None:
        self._follow_lr_rule()
        self._follow_data_position()
        for logger in self.loggers:
            logger.log_metrics(
                {"optim/lr_scaled": self.scaled_lr, "optim/global_batch": self.global_batch_size()},
                step=self.global_step,
            )  # a resume's: at its step, not 0 again
            if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:  # the run config, readable
                text = yaml.safe_dump(self.hparams.get("config") or {}, sort_keys=False)
                logger.experiment.add_text("config", f"```yaml\n{text}```", global_step=self.global_step)

    def setup(self, stage: str) -> None:
        """Before the first step: the datamodule's whole label set against model.num_classes (RAM data), and a
        latent data set's shape against model.in_channels and model.image_size (data=latents)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if stage != "fit" or datamodule is None:
            return
        if (check_labels := getattr(datamodule, "check_labels", None)) is not None:
            check_labels(self.net.num_classes)
        if (check_model := getattr(datamodule, "check_model", None)) is not None:
            check_model(self.net.in_channels, self.net.image_size)

    def on_train_end(self) -> None:
        self.check_labels_seen()

    def on_validation_epoch_start(self) -> None:
        self.val_means.reset()

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_means.reduce(self), sync_dist=True)  # equal on every rank (Lightning warns without)
        self.check_labels_seen()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_labels_seen()  # never a checkpoint of a run that trained on labels it cannot have
        # What a resume at another scale compares with (ddpm.resume.checkpoint_world).
        checkpoint["world"] = {"world_size": self.trainer.world_size, "global_batch": self.global_batch_size(),
                               "lr": self.scaled_lr}  # fmt: skip

    def _follow_lr_rule(self) -> None:
        """After a resume, the LR of this run's rule and global batch, not the checkpoint's: Lightning restores
        the optimizer's and the schedule's base LR, scaled for the run that saved them (another world size, batch,
        accumulation or optim.lr), and its LR at the checkpoint's step of a schedule for the checkpoint's
        trainer.max_steps (a decay ends there). The warm-up position (the schedule's step) carries on."""
        schedule = self.lr_schedulers()
        optimizer = self.optimizers(use_pl_optimizer=False)
        resumed = self.trainer.ckpt_path is not None and isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
        if not resumed:
            return  # a fresh run, or another schedule (the LR range test's)
        old = schedule.base_lrs[0]
        schedule.base_lrs = [self.scaled_lr] * len(optimizer.param_groups)
        factor = self.optim.lr_factor(schedule.last_epoch, self.trainer.max_steps)  # this run's max_steps: its decay
        for group in optimizer.param_groups:  # the checkpoint's LR is its schedule's, for its own max_steps
            group["initial_lr"], group["lr"] = self.scaled_lr, self.scaled_lr * factor
        if self.trainer.is_global_zero and old != self.scaled_lr:
            rule = f"optim.lr={self.optim.lr:g}, optim.scaling={self.optim.scaling}"
            rule = f"global batch {self.global_batch_size()}, {rule}"
            say(f"LR after the resume: {self.scaled_lr:.6g} ({rule}); the checkpoint's was {old:.6g}")

    def _follow_data_position(self) -> None:
        """Lightning's batch count within the epoch follows the training loader's position after a resume at
        another world size or batch size (data/sampler.py: the samples seen are skipped globally)."""
        loader = self.trainer.train_dataloader
        if (done := loader.position_for(self.current_epoch) if hasattr(loader, "position_for") else None) is not None:
            progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
            shift = done - progress.ready  # all four counts move alike: their restored differences stay
            for name in ("ready", "started", "processed", "completed"):
                setattr(progress, name, getattr(progress, name) + shift)


def check_batch(batch: Batch, net: UNet, *, latent: bool = False) -> None:
    """Reject a batch the model cannot learn from, naming the config value to change. Latents (data=latents) have
    their own range: only their shape and finiteness are checked (their shape also at setup, against the VAE's)."""
    x0, y = batch
    if x0.ndim != 4 or x0.shape[1] != net.in_channels:
        raise ValueError(
            f"the data gives images of shape {tuple(x0.shape[1:])} (C, H, W) but model.in_channels={net.in_channels}; "
            f"set model.in_channels={x0.shape[1] if x0.ndim == 4 else '?'} or convert the data (data.channels)"
        )
    if tuple(x0.shape[2:]) != (net.image_size, net.image_size):
        raise ValueError(
            f"the data gives {x0.shape[2]}x{x0.shape[3]} images but model.image_size={net.image_size}; "
            "set data.image_size and model.image_size to the same value"
        )
    low, high = torch.aminmax(x0.float())
    if latent and not torch.isfinite(low + high):
        raise ValueError("a batch of latents holds NaN/inf: the encoded latents are damaged; encode the data again")
    if not latent and (low < -1.001 or high > 1.001 or not torch.isfinite(low + high)):
        raise ValueError(
            f"a batch after scaling spans [{low.item():.3g}, {high.item():.3g}], not [-1, 1]; the datamodule must "
            "yield uint8 images in [0, 255] (scaled on the device as x / 127.5 - 1)"
        )
    if net.num_classes is not None and (y.min() < 0 or y.max() >= net.num_classes):
        raise ValueError(label_error("the first batch's labels", int(y.min()), int(y.max()), net.num_classes))


def label_error(what: str, low: int, high: int, num_classes: int) -> str:
    """The message for labels outside 0..num_classes-1 (the label num_classes is the null class of guidance)."""
    fix = f"set model.num_classes={high + 1}" if low >= 0 else "labels must be >= 0: check the dataset's labels"
    return (
        f"{what} span [{low}, {high}] but model.num_classes={num_classes}: labels must be 0..{num_classes - 1} "
        f"(label {num_classes} is the null class of classifier-free guidance); {fix}, or remove those images"
    )
