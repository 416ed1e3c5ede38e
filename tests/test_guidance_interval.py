"""Guidance in a limited interval (Kynkaanniemi et al. 2024) against closed forms: the guided mix
(1 + w) cond - w uncond only where sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) lies in (sigma_lo, sigma_hi], the
conditional network alone (B rows, not 2B) elsewhere; through generate() and sample.py."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, compose, denoiser, perturbed_unet, sample, tiny_unet_config
from omegaconf import OmegaConf

from ddpm.config import validate_config
from ddpm.diffusion.generate import generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.schedule import linear_betas, respaced_timesteps
from ddpm.sampling.runtime import guidance_interval
from ddpm.weights.torch_file import export_ema

BETAS = linear_betas(1000).double()
NULL = 10


def sigmas_numpy() -> np.ndarray:
    """sigma_t of the linear schedule, computed apart from the code under test."""
    alpha_bar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    return np.sqrt((1 - alpha_bar) / alpha_bar)


class Constant:
    """net(x, t, y): 1.5 for a label, 0.5 for the null class; records the rows of every call."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x, t, y):
        self.rows.append(len(x))
        return torch.where(y == NULL, 0.5, 1.5).view(-1, 1, 1, 1).expand_as(x).clone()


def test_sigma_agrees_with_an_independent_schedule() -> None:
    assert np.allclose(denoiser(Constant(), BETAS).sigmas.numpy(), sigmas_numpy(), rtol=1e-12)


def test_rows_inside_are_guided_and_rows_outside_are_conditional_in_one_batch() -> None:
    sigma = sigmas_numpy()
    t = torch.tensor([0, 250, 400, 999])  # sigma ~0.01, ~0.95, ~2.2, ~157
    lo, hi = 0.5, 5.0
    net = Constant()
    d = denoiser(net, BETAS, guidance=2.0, null_class=NULL, guidance_interval=(lo, hi))
    eps = d(torch.zeros(4, 1, 2, 2), d.sigmas[t], torch.full((4,), 3)).eps
    inside = (sigma[t.numpy()] > lo) & (sigma[t.numpy()] <= hi)
    assert inside.tolist() == [False, True, True, False]
    expected = np.where(inside, 3 * 1.5 - 2 * 0.5, 1.5)  # (1 + w) cond - w uncond, or cond
    assert np.allclose(eps[:, 0, 0, 0].numpy(), expected)
    assert net.rows == [8]  # one batched [cond; uncond] call for the mixed batch


@pytest.mark.parametrize(("t", "rows", "eps"), [(999, 4, 1.5), (300, 8, 3.5), (1, 4, 1.5)])
def test_a_step_outside_calls_the_network_on_b_rows_only(t: int, rows: int, eps: float) -> None:
    net = Constant()
    d = denoiser(net, BETAS, guidance=2.0, null_class=NULL, guidance_interval=(0.3, 5.0))
    out = d(torch.zeros(4, 1, 2, 2), d.sigmas[torch.full((4,), t)], torch.full((4,), 7)).eps
    assert net.rows == [rows] and torch.allclose(out, torch.full_like(out, eps)) and d.calls == 1


def draw(net, *, guidance: float, guidance_interval: tuple[float, float] | None = None) -> torch.Tensor:
    d = denoiser(net, BETAS, guidance=guidance, null_class=NULL, guidance_interval=guidance_interval)
    return generate(d, DDIMSampler(steps=10), (6, 1, 8, 8), labels=torch.arange(6) % 10, seed=3, batch_size=6).images


def test_an_interval_holding_every_step_is_plain_guidance_and_an_empty_one_is_none() -> None:
    net = perturbed_unet()
    guided, unguided = draw(net, guidance=2.0), draw(net, guidance=0.0)
    assert not torch.equal(guided, unguided)
    assert torch.equal(draw(net, guidance=2.0, guidance_interval=(0.0, 1e4)), guided)
    assert torch.equal(draw(net, guidance=2.0, guidance_interval=(200.0, 300.0)), unguided)  # above sigma_max ~157
    middle = draw(net, guidance=2.0, guidance_interval=(0.3, 5.0))
    assert not torch.equal(middle, guided) and not torch.equal(middle, unguided)


def test_only_the_steps_inside_run_the_doubled_batch() -> None:
    """DDIM-10's timesteps whose sigma is in (0.3, 5] (closed form) are exactly the calls of 2B rows."""
    rows: list[int] = []
    net = perturbed_unet()

    def counted(x, t, y):
        rows.append(len(x))
        return net(x, t, y)

    draw(counted, guidance=1.0, guidance_interval=(0.3, 5.0))
    sigma = sigmas_numpy()[respaced_timesteps(1000, 10).numpy()]
    inside = int(((sigma > 0.3) & (sigma <= 5.0)).sum())
    assert 0 < inside < 10
    assert sorted(rows) == sorted([12] * inside + [6] * (10 - inside))


@pytest.mark.parametrize("bad", [[5.0, 0.3], [1.0], [-1.0, 2.0], [2.0, 2.0]])
def test_a_bad_interval_is_refused_naming_the_key(bad: list[float]) -> None:
    with pytest.raises(ValueError, match=r"guidance_interval=.*sigma_lo.*guidance_interval=null"):
        guidance_interval(bad)
    with pytest.raises(ValueError, match="sigma_lo"):
        denoiser(Constant(), BETAS, guidance=1.0, null_class=NULL, guidance_interval=tuple(bad))


def test_sample_config_takes_an_interval_or_null() -> None:
    def config(*overrides: str):
        return compose("sample", ["ckpt=x", "output_dir=/tmp/x", *overrides])

    validate_config(config("guidance_interval=[0.3,5]"), entry="sample")
    validate_config(config(), entry="sample")
    with pytest.raises(Exception, match="guidance_interval"):
        validate_config(config("guidance_interval=[a,b]"), entry="sample")


@pytest.mark.slow
def test_sample_py_with_an_interval_draws_between_guided_and_unguided(tmp_path: Path) -> None:
    """sample.py on an ema.pt of the perturbed tiny network above: the interval reaches the sampler."""
    diffusion = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "diffusion" / "linear.yaml"))
    config = {"model": tiny_unet_config(10), "diffusion": diffusion}
    ckpt = export_ema(tmp_path / "ema.pt", perturbed_unet().state_dict(), config)
    images = {}
    for name, extra in {"all": [], "mid": ["guidance_interval=[0.3,5]"], "none": ["guidance=0"]}.items():
        out = tmp_path / name
        sample(f"ckpt={ckpt}", "num_samples=6", "sampler=ddim", "sampler.steps=10", "guidance=2", "precision=32",
               *extra, f"output_dir={out}")  # fmt: skip
        with np.load(out / "samples.npz") as npz:
            images[name] = npz["images"]
    assert not np.array_equal(images["mid"], images["all"]) and not np.array_equal(images["mid"], images["none"])
    refused = sample(f"ckpt={ckpt}", "guidance=2", "guidance_interval=[5,0.3]", f"output_dir={tmp_path / 'x'}",
                     check=False)  # fmt: skip
    assert refused.returncode != 0 and "guidance_interval=[5, 0.3]: guidance interval" in refused.stderr
    assert not (tmp_path / "x" / "samples.npz").exists()


def test_callbacks_take_the_interval_and_name_their_key_when_it_is_bad() -> None:
    from ddpm.callbacks.fid import FID
    from ddpm.callbacks.sample_grid import SampleGrid

    grid = SampleGrid(sampler=DDIMSampler(steps=2), guidance=1.0, guidance_interval=[0.3, 5])
    assert grid.guidance_interval == (0.3, 5.0)
    with pytest.raises(ValueError, match=r"callbacks\.sample_grid\.guidance_interval=\[5, 0\.3\]"):
        SampleGrid(sampler=DDIMSampler(steps=2), guidance=1.0, guidance_interval=[5, 0.3])
    with pytest.raises(ValueError, match=r"callbacks\.fid\.guidance_interval=\[1\]"):
        FID(sampler=DDIMSampler(steps=2), guidance=1.0, guidance_interval=[1])


def test_the_grid_draws_with_its_interval(monkeypatch) -> None:
    """SampleGrid -> sample_with_ema -> generate: the interval reaches the sampler (images as generate's own)."""
    from types import SimpleNamespace

    from ddpm.callbacks import sample_grid
    from ddpm.diffusion.gaussian import GaussianDiffusion

    net = perturbed_unet()
    module = SimpleNamespace(net=net, diffusion=GaussianDiffusion(), device=torch.device("cpu"), hparams={})
    trainer = SimpleNamespace(callbacks=[])
    drawn = sample_grid.sample_with_ema(trainer, module, sampler=DDIMSampler(steps=10), num_samples=6, guidance=2.0,
                                        seed=3, batch_size=6, precision="32", guidance_interval=(0.3, 5.0))  # fmt: skip
    assert torch.equal(drawn.images, draw(net, guidance=2.0, guidance_interval=(0.3, 5.0)))
