"""Edges found in review: true half precision, too few linear timesteps, mixed image modes, divergence that
never produces a NaN. Each test fails without its fix."""

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import TINY_RUN, compose, train
from PIL import Image

from ddpm.callbacks.nan_guard import DivergenceError, NaNGuard, NonFiniteLossError
from ddpm.data.sources import ImageFolderSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.schedule import alpha_bar_from_betas, linear_betas, make_betas
from ddpm.training import resolve_config

# --- trainer.precision=*-true casts the schedule -----------------------------------------------------------------


def test_bf16_alpha_bar_is_exactly_one_for_the_first_timesteps() -> None:
    """The fact behind the refusal, in closed form: 1 - alpha_bar_t < 2**-9 (half of bf16's spacing 2**-8 below 1) for
    t < 10 of the linear schedule, so bf16 rounds those alpha_bar to 1: x_t = x_0, no noise at all."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alpha_bar = torch.cumprod(1 - betas, 0)
    below = (1 - alpha_bar < 2**-9).nonzero().flatten().tolist()
    assert below == list(range(10))
    assert (alpha_bar.bfloat16()[:10] == 1).all() and (alpha_bar.float()[:10] < 1).all()


@pytest.mark.parametrize(("precision", "fix"), [("bf16-true", "bf16-mixed"), ("16-true", "16-mixed")])
def test_true_half_precision_is_refused_before_anything_is_built(tmp_path: Path, precision: str, fix: str) -> None:
    cfg = compose("train", [f"trainer.precision={precision}", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=rf"trainer.precision={precision} casts .* alpha_bar .*{fix}"):
        resolve_config(cfg)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "64-true", "auto"])
def test_other_precisions_pass(tmp_path: Path, precision: str) -> None:
    resolve_config(compose("train", [f"trainer.precision={precision}", f"paths.output_dir={tmp_path}"]))


# --- linear schedule with T <= 20 ---------------------------------------------------------------------------------


def test_linear_schedule_with_twenty_steps_or_fewer_is_refused_naming_the_smallest_t() -> None:
    """Betas scale by 1000/T, so the last is 0.02 * 1000 / T >= 1 for T <= 20: alpha_bar_{T-1} <= 0."""
    assert linear_betas(20)[-1].item() == pytest.approx(1.0) and alpha_bar_from_betas(linear_betas(20))[-1] <= 0
    for steps in (2, 10, 20):
        with pytest.raises(ValueError, match=r"num_timesteps>=21 \(the smallest T that works\)"):
            make_betas("linear", steps)
        with pytest.raises(ValueError, match=r"diffusion\.num_timesteps"):
            GaussianDiffusion(num_timesteps=steps, schedule="linear")
    alpha_bar = alpha_bar_from_betas(make_betas("linear", 21))
    assert (alpha_bar > 0).all() and (alpha_bar <= 1).all() and (alpha_bar.diff() < 0).all()
    assert (alpha_bar_from_betas(make_betas("cosine", 10)) > 0).all()  # cosine clips its betas at 0.999


# --- image_folder with grey, RGBA, palette and 16-bit files among RGB ones ------------------------------------------

RGB = (200, 40, 10)


def luma(r: float, g: float, b: float) -> float:
    """ITU-R 601-2, as PIL converts RGB to L."""
    return r * 299 / 1000 + g * 587 / 1000 + b * 114 / 1000


def write_modes(root: Path) -> dict[str, tuple[int, int, int]]:
    """One 8x8 flat image per mode under root/<class>/, and the RGB each should load as."""
    files: dict[str, tuple[Image.Image, tuple[int, int, int]]] = {
        "rgb": (Image.new("RGB", (8, 8), RGB), RGB),
        "grey": (Image.new("L", (8, 8), 90), (90, 90, 90)),
        "rgba_opaque": (Image.new("RGBA", (8, 8), (*RGB, 255)), RGB),
        "rgba_clear": (Image.new("RGBA", (8, 8), (*RGB, 0)), (255, 255, 255)),  # onto white, not the hidden colour
        "rgba_half": (Image.new("RGBA", (8, 8), (0, 0, 0, 128)), (127, 127, 127)),  # 255 * (1 - 128/255)
        "grey_alpha": (Image.new("LA", (8, 8), (0, 0)), (255, 255, 255)),
        "grey16": (Image.fromarray(np.full((8, 8), 65535 // 2, dtype=np.uint16)), (127, 127, 127)),
    }
    palette = Image.new("RGB", (8, 8), RGB).quantize(colors=4)
    files["palette"] = (palette, RGB)
    clear = Image.new("RGB", (8, 8), RGB).quantize(colors=4)
    clear.info["transparency"] = clear.getpixel((0, 0))  # the palette index of every pixel is transparent
    files["palette_clear"] = (clear, (255, 255, 255))
    for name, (image, _) in files.items():
        (root / name).mkdir(parents=True)
        image.save(root / name / f"{name}.png")
    return {name: rgb for name, (_, rgb) in files.items()}


def test_image_folder_converts_every_mode_to_the_model_channels(tmp_path: Path) -> None:
    expected = write_modes(tmp_path)
    assert Image.open(tmp_path / "grey16" / "grey16.png").mode.startswith("I")  # a real 16-bit file
    assert Image.open(tmp_path / "palette_clear" / "palette_clear.png").mode == "P"
    names = sorted(expected)  # classes are the sorted folder names
    rgb = ImageFolderSource(root=str(tmp_path)).load(image_size=8, channels=3)
    grey = ImageFolderSource(root=str(tmp_path)).load(image_size=8, channels=1)
    assert rgb.images.shape == (len(names), 3, 8, 8) and grey.images.shape == (len(names), 1, 8, 8)
    for index, name in enumerate(names):
        assert rgb.labels[index] == index
        got = rgb.images[index].float().mean((1, 2)).tolist()
        assert got == pytest.approx(expected[name], abs=1.0), name
        assert grey.images[index].float().mean().item() == pytest.approx(luma(*expected[name]), abs=1.0), name


# --- divergence without NaN -----------------------------------------------------------------------------------------


def drive(guard: NaNGuard, losses: list[float], grad_scale: float = 1.0) -> int:
    """Feed `guard` one optimizer step per loss (batch end, then the next step's check); returns the steps taken."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    checkpoint = SimpleNamespace(last_model_path="run/checkpoints/last.ckpt")
    trainer = SimpleNamespace(global_step=0, checkpoint_callback=checkpoint, fast_dev_run=False,
                              strategy=SimpleNamespace(reduce=lambda x, reduce_op: x),
                              _logger_connector=SimpleNamespace(should_update_logs=False))  # fmt: skip
    module = SimpleNamespace(log=lambda *a, **k: None)
    for step, loss in enumerate(losses):
        trainer.global_step = step
        param.grad = torch.full((4,), grad_scale)
        guard.on_before_optimizer_step(trainer, module, optimizer)
        guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(loss)}, None, step)
    return len(losses)


def test_a_loss_far_above_its_running_level_stops_the_run_naming_the_lr_and_the_checkpoint() -> None:
    steady = [1.0 / (1 + 0.01 * i) for i in range(60)]  # a slowly falling loss: never stops
    guard = NaNGuard(divergence_factor=10, divergence_patience=5)
    drive(guard, steady + [1.5, 0.5] * 20)  # noisy but not diverged
    assert guard.above == 0 and guard.level == pytest.approx(sum(steady[-50:]) / 50, rel=0.2)
    guard = NaNGuard(divergence_factor=10, divergence_patience=5)
    with pytest.raises(DivergenceError) as info:
        drive(guard, [*steady, *[1e6] * 10])
    message = str(info.value)
    assert "diverged" in message and "5 optimizer steps in a row" in message
    assert "optim.lr" in message and "run/checkpoints/last.ckpt" in message
    assert not isinstance(info.value, NonFiniteLossError)


def test_a_gradient_norm_that_overflows_float32_is_a_skipped_step() -> None:
    """Every element is finite (1e30) but the global 2-norm is 2e30 * ... > 3.4e38: clipping would zero the
    gradients and Adam would go on moving the weights on its moments. Such steps are skipped and stop the run."""
    grads = torch.full((4,), 1e30)
    assert grads.isfinite().all() and not math.isfinite(torch.linalg.vector_norm(grads).item())
    guard = NaNGuard(max_consecutive=3)
    with pytest.raises(NonFiniteLossError, match=r"overflowed.* 3 optimizer steps in a row, up to step 3"):
        drive(guard, [1.0] * 5, grad_scale=1e30)
    assert guard.skipped == 3


def test_guard_state_round_trips_through_a_checkpoint_dict() -> None:
    guard = NaNGuard()
    drive(guard, [1.0, 0.9, 0.8] * 10)
    restored = NaNGuard()
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict() and math.isfinite(restored.level)


@pytest.mark.slow
def test_train_py_with_an_absurd_lr_stops_with_the_divergence_message(tmp_path: Path) -> None:
    """The review's run: optim.lr=1e12 optim.warmup_steps=0 logged train/loss 3.5e28 and an inf grad norm from step
    24 on and went on for ever. It must stop, naming the LR, with its finished checkpoints intact."""
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "trainer.max_steps=300", "callbacks.checkpoint.every_n_train_steps=10",
                 "callbacks.sample_grid=null", "trainer.val_check_interval=50"]  # fmt: skip
    result = train(*overrides, "optim.lr=1e12", "optim.warmup_steps=0", f"hydra.run.dir={run_dir}", check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "NonFiniteLossError" in output or "DivergenceError" in output, output[-3000:]
    assert "optim.lr" in output and "Last good checkpoint" in output
    with (run_dir / "csv" / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert max(steps) < 150, max(steps)  # stopped, long before max_steps
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(v.isfinite().all() for v in state.values()), path
