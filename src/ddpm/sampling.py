"""sample(cfg): load a run's EMA weights, draw images, write grid.png and samples.npz."""

from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig
from torch import Tensor
from torchvision.utils import make_grid, save_image

from ddpm.checkpoint import load_ema_model
from ddpm.diffusion.generate import Generated, class_cycle, generate


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use device=cpu or device=auto")
    return torch.device(name)


def requested_labels(labels: int | list[int] | None, num_samples: int, num_classes: int | None) -> Tensor | None:
    """(N,) int64: the given labels repeated in turn, or every class in turn; None for unconditional models."""
    if num_classes is None:
        if labels is not None:
            raise ValueError(f"labels={labels} given, but the model is unconditional; leave labels unset")
        return None
    if labels is None:
        return class_cycle(num_samples, num_classes)
    wanted = torch.tensor([labels] if isinstance(labels, int) else list(labels), dtype=torch.long)
    if len(wanted) == 0 or wanted.min() < 0 or wanted.max() >= num_classes:
        raise ValueError(
            f"labels={wanted.tolist()} must be in 0..{num_classes - 1} (the model has {num_classes} classes)"
        )
    return wanted[torch.arange(num_samples) % len(wanted)]


def write_outputs(out: Generated, out_dir: Path, nrow: int) -> None:
    """grid.png (at most 256 images) and samples.npz: images (N, H, W, C) uint8, labels (N,) int64."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = out.images[:256].float() / 255.0
    save_image(make_grid(shown, nrow=nrow, padding=2, pad_value=1.0), out_dir / "grid.png")
    labels = out.labels.numpy() if out.labels is not None else np.full(len(out.images), -1, dtype=np.int64)
    np.savez(out_dir / "samples.npz", images=out.images.permute(0, 2, 3, 1).numpy(), labels=labels)


def sample(cfg: DictConfig) -> Generated:
    """Run the sampling described by conf/sample.yaml; returns the images and their labels."""
    if not cfg.get("ckpt"):
        raise ValueError("no checkpoint given; pass ckpt=<run dir>/checkpoints/last.ckpt or ckpt=<run dir>/ema.pt")
    if cfg.num_samples <= 0:
        raise ValueError(f"num_samples={cfg.num_samples} must be > 0")
    device = resolve_device(cfg.device)
    loaded = load_ema_model(cfg.ckpt, device)
    net, diffusion = loaded.net, loaded.diffusion
    labels_cfg = list(cfg.labels) if isinstance(cfg.labels, ListConfig) else cfg.labels
    labels = requested_labels(labels_cfg, cfg.num_samples, net.num_classes)
    out = generate(
        net=net,
        betas=diffusion.betas64(),
        prediction=diffusion.prediction,
        sampler=instantiate(cfg.sampler),
        image_shape=(net.in_channels, net.image_size, net.image_size),
        num_samples=cfg.num_samples,
        labels=labels,
        null_class=net.num_classes,
        guidance=cfg.guidance,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        device=device,
    )
    out_dir = Path(cfg.output_dir)
    write_outputs(out, out_dir, nrow=net.num_classes or int(len(out.images[:256]) ** 0.5))
    print(
        f"{len(out.images)} images in {out.seconds:.1f} s ({out.images_per_second:.2f} images/s, "
        f"{out.nfe} network evaluations per batch) -> {out_dir / 'grid.png'}, {out_dir / 'samples.npz'}"
    )
    return out
