"""Edges found in review: true half precision, too few linear timesteps, mixed image modes. Each test fails without
its fix. (Divergence that never produces a NaN: tests/test_divergence.py.)"""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose
from omegaconf import OmegaConf
from PIL import Image

from ddpm.config.build import build
from ddpm.data.image_folder import ImageFolderSource
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


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "auto"])  # 64-true: refused (test_user_faults.py)
def test_other_precisions_pass(tmp_path: Path, precision: str) -> None:
    resolve_config(compose("train", [f"trainer.precision={precision}", f"paths.output_dir={tmp_path}"]))


# --- linear schedule with T <= 20 ---------------------------------------------------------------------------------


def test_linear_schedule_with_twenty_steps_or_fewer_is_refused_naming_the_smallest_t() -> None:
    """Betas scale by 1000/T, so the last is 0.02 * 1000 / T >= 1 for T <= 20: alpha_bar_{T-1} <= 0."""
    assert linear_betas(20)[-1].item() == pytest.approx(1.0) and alpha_bar_from_betas(linear_betas(20))[-1] <= 0
    for steps in (2, 10, 20):
        with pytest.raises(ValueError, match=r"num_timesteps>=21 \(the smallest T that works\)"):
            make_betas("linear", steps)
        refusal = rf"schedule=linear with num_timesteps={steps} gives betas in \[.*\], not inside \(0, 1\)"
        with pytest.raises(ValueError, match="^" + refusal):
            GaussianDiffusion(num_timesteps=steps, schedule="linear")
        node = {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": steps, "schedule": "linear"}
        keyed = rf"^diffusion\.schedule=linear with diffusion\.num_timesteps={steps} gives betas"
        with pytest.raises(ValueError, match=keyed):
            build(OmegaConf.create({"diffusion": node}).diffusion)
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
