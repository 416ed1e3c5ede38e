"""Training memory estimate: parameters, gradients, AdamW state and activations, for a config.

    python -m ddpm.memory model=seed_mnist data.batch_size=128 [trainer.precision=bf16-mixed] [--measure-batch 4]

Parameters, gradients and optimizer state are counted from the model (AdamW: two float32 moments per
parameter). Activations are measured, not guessed: one real forward + backward of the diffusion loss at a
small batch (`--measure-batch`) and at twice it, summing the bytes autograd saves for backward (saved_tensors_hooks,
each storage once, parameters excluded): the part that grows with the batch is scaled to data.batch_size, the rest
(autocast's low-precision copies of the weights) counted once. The total leaves out the CUDA
context, allocator fragmentation and temporaries of backward (allow ~20-30% more on a GPU).
"""

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from ddpm.config import CONF, build, validate_config
from ddpm.precision import resolve_precision

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def tensor_bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_tensor_bytes(fn: Callable[[], Tensor], *, exclude: list[Tensor] = ()) -> int:
    """Bytes autograd keeps for backward while `fn()` builds its graph (each storage once, `exclude` skipped);
    then runs backward so the graph is freed."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and storage.device.type != "meta":
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    out.backward()
    return sum(seen.values())


def estimate(
    net: nn.Module,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor],
    *,
    batch_size: int,
    image_shape: tuple[int, int, int],
    num_classes: int | None,
    measure_batch: int = 4,
    precision: str = "32-true",
    device: str = "cpu",
) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state, the EMA's average and activations (measured at
    `measure_batch`, scaled)."""
    params = [p for p in net.parameters() if p.requires_grad]
    net = net.to(device).train()
    dtype = AUTOCAST.get(str(precision))
    device_type = torch.device(device).type

    def saved(n: int) -> int:
        x = torch.randn(n, *image_shape, device=device)
        y = torch.randint(0, num_classes, (n,), device=device) if num_classes else None

        def step() -> Tensor:
            with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
                return loss_fn(net, x, y)

        return saved_tensor_bytes(step, exclude=list(net.parameters()))

    # Saved bytes = fixed + per_image x batch: autocast saves each weight's low-precision copy once, whatever the
    # batch; scaling the whole measurement counted those copies batch_size / n times.
    n = min(measure_batch, batch_size)
    one, two = saved(n), saved(2 * n)
    per_image = (two - one) / n
    activations = max(0.0, one - per_image * n) + per_image * batch_size
    net.zero_grad(set_to_none=True)
    parameter_bytes = tensor_bytes(params)
    return {
        "parameters": parameter_bytes,
        "gradients": parameter_bytes,
        "optimizer": 2 * sum(p.numel() * 4 for p in params),  # AdamW exp_avg + exp_avg_sq, float32
        "ema": sum(t.numel() * 4 for t in [*net.parameters(), *net.buffers()]),  # the EMA callback's float32 copy
        "activations": round(activations),
    }


def report(sizes: dict[str, int], *, count: int, batch_size: int) -> str:
    total = sum(sizes.values())
    lines = [f"{'parameters (count)':<20}{count / 1e6:>10.2f} M"]
    lines += [f"{name:<20}{value / 2**20:>10.1f} MiB" for name, value in sizes.items()]
    lines.append(f"{'total':<20}{total / 2**20:>10.1f} MiB  (batch {batch_size}; + CUDA context, fragmentation)")
    return "\n".join(lines)


def missing(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys a config (plain data, unresolved) leaves ??? (mandatory, unset)."""
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in missing(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "???" else []


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train.py overrides: model=..., data.batch_size=...")
    parser.add_argument("--measure-batch", type=int, default=4, help="batch of the measured forward/backward")
    parser.add_argument("--device", default="cpu", help="device of the measured step (cpu, cuda)")
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    cfg.paths.output_dir = "unused"  # Hydra's run folder: none here
    for key in missing(OmegaConf.to_container(cfg, resolve=False)):  # data.root of image_folder: no data read here
        OmegaConf.update(cfg, key, "unused")
    validate_config(cfg, entry="train")  # types, ranges and unknown keys as train.py checks them (1.5 was int()ed)
    if cfg.get("diffusion") is None:  # module=vae: no diffusion loss to measure
        raise SystemExit("python -m ddpm.memory estimates a diffusion model's training step; this config has "
                         "diffusion=null (a VAE run, module=vae)")  # fmt: skip
    net, diffusion = build(cfg.model), build(cfg.diffusion).to(args.device)
    batch_size = int(cfg.data.batch_size)
    if batch_size < 1:  # validate_config checks types; the data module the range, and it is not built here
        raise ValueError(f"data.batch_size={batch_size} must be >= 1")
    precision = resolve_precision(cfg.trainer.precision, "cuda" if args.device.startswith("cuda") else "cpu")

    def loss_fn(model: nn.Module, x0: Tensor, y: Tensor | None) -> Tensor:
        t = diffusion.sample_timesteps(x0.shape[0], x0.device)
        return diffusion.loss(model, x0, t, torch.randn_like(x0), y)

    sizes = estimate(
        net, loss_fn, batch_size=batch_size, image_shape=(net.in_channels, net.image_size, net.image_size),
        num_classes=net.num_classes, measure_batch=args.measure_batch, precision=precision, device=args.device,
    )  # fmt: skip
    count = sum(p.numel() for p in net.parameters())
    print(f"{' '.join(args.overrides) or 'defaults'}: precision={precision}, batch={batch_size}")
    print(report(sizes, count=count, batch_size=batch_size))
    return {"parameter_count": count, "batch_size": batch_size, **sizes}


@contextmanager
def explain_oom(*, batch_size: Any, precision: Any) -> Iterator[None]:
    """Re-raise CUDA out-of-memory errors with the settings that reduce memory."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"out of device memory ({str(error).splitlines()[0][:200]}). The batch does not fit: lower "
            f"data.batch_size={batch_size} (and raise trainer.accumulate_grad_batches to keep the global batch), use "
            f"trainer.precision=bf16-mixed (now {precision}), or turn on activation checkpointing in the model"
        ) from error


if __name__ == "__main__":
    import sys

    from hydra.errors import HydraException

    from ddpm.config.overrides import hint_misspelled_overrides

    with hint_misspelled_overrides("train", [a for a in sys.argv[1:] if not a.startswith("-")]):
        try:
            main()
        except (ValueError, HydraException) as error:  # each names what to change
            print(f"python -m ddpm.memory: error: {error}", file=sys.stderr)
            sys.exit(1)
