"""diffusion=edm (Karras et al. 2022) against closed forms and independent formulations.

- Table 1: c_skip, c_out, c_in, lambda at chosen sigmas, written out by hand; lambda c_out^2 = 1; the F-form loss
  equals lambda ||D - x0||^2 (eq. 2) computed from D directly.
- Sec. 5 / appendix B.6: for data of standard deviation sigma_data the network input c_in x and its target both
  have unit variance at every sigma (Monte Carlo, 200k Gaussian pixels).
- The levels are eq. 5's grid (its closed form at the ends and an interior index), and alpha_bar = 1 / (1 + sigma^2)
  survives betas -> cumprod (what an export's scheduler sees) to 1e-9.
- Training noise: ln sigma of the drawn levels has mean P_mean and std P_std; nearest_level is a brute-force argmin.
- Sampling coordinates: a network that returns the exact target F* gives back x0 and eps exactly through
  the denoiser's VP x_t (an independent path from the training side's x = x0 + sigma n), and it is called on c_in x.
- The ideal denoiser of Gaussian data N(0, sigma_data^2) is D = c_skip x (F = 0); the probability-flow ODE then has
  the closed-form solution x(sigma) = x(sigma_0) sqrt((sigma^2 + sigma_data^2) / (sigma_0^2 + sigma_data^2)): EDM's
  Heun and DPM-Solver++ on these levels reach it.
- Export: the adapter folder's eps equals the denoiser's, and diffusers' DDIMPipeline draws our sampler=ddim images.
- A real `python train.py diffusion=edm`, then sample.py and a resume that changes sigma_data (refused).
"""

import math

import numpy as np
import pytest
import torch
from helpers import TINY_RUN, denoiser, sample, tiny_unet, tiny_unet_config, train
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion import precond
from ddpm.diffusion.edm import EDMDiffusion, edm_sigmas
from ddpm.diffusion.generate import batch_seed, denoiser_for, generate, to_uint8
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.diffusion.samplers.edm import EDMSampler
from ddpm.diffusion.schedule import alpha_bar_from_betas
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.torch_file import export_ema

SD = 0.5  # sigma_data


def test_preconditioning_is_table_1():
    sigma = torch.tensor([0.002, 0.5, 1.0, 80.0], dtype=torch.float64)
    for s, skip, out, inp in zip(
        sigma.tolist(),
        precond.c_skip(sigma, SD).tolist(),
        precond.c_out(sigma, SD).tolist(),
        precond.c_in(sigma, SD).tolist(),
        strict=True,
    ):
        assert skip == pytest.approx(0.25 / (s * s + 0.25), rel=1e-12)
        assert out == pytest.approx(s * 0.5 / math.sqrt(s * s + 0.25), rel=1e-12)
        assert inp == pytest.approx(1 / math.sqrt(s * s + 0.25), rel=1e-12)
    assert precond.c_skip(torch.tensor(0.5), 0.5) == pytest.approx(0.5)  # sigma = sigma_data: half skip
    weight = precond.loss_weight(sigma, SD) * precond.c_out(sigma, SD) ** 2
    torch.testing.assert_close(weight, torch.ones_like(sigma), rtol=1e-12, atol=0)


def test_loss_is_lambda_weighted_denoiser_error():
    """EDMDiffusion.loss (F form, eq. 8) equals E[lambda(sigma) ||D(x; sigma) - x0||^2] (eq. 2) with D built from F."""
    diffusion = EDMDiffusion(num_timesteps=100)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(6, 1, 8, 8, generator=g) * 2 - 1, torch.randn(6, 1, 8, 8, generator=g)
    t = torch.tensor([0, 10, 40, 60, 90, 99])
    net = tiny_unet().eval()
    with torch.no_grad():
        loss = diffusion.loss(net, x0, t, noise)
        sigma = diffusion.sigmas64()[t].view(-1, 1, 1, 1)
        x = x0.double() + sigma * noise.double()
        f = net((x / (sigma**2 + SD**2).sqrt()).float(), t, None).double()
        d = SD**2 / (sigma**2 + SD**2) * x + sigma * SD / (sigma**2 + SD**2).sqrt() * f
        lam = (sigma**2 + SD**2) / (sigma * SD) ** 2
        expected = (lam * (d - x0.double()) ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("sigma", [0.002, 0.1, 0.5, 2.0, 80.0])
def test_network_input_and_target_have_unit_variance(sigma):
    """Karras et al. sec. 5: with data of std sigma_data, Var(c_in x) = 1 and Var(F*) = 1 at every sigma."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(200_000, generator=g, dtype=torch.float64) * SD
    x = x0 + sigma * torch.randn(200_000, generator=g, dtype=torch.float64)
    s = torch.tensor(sigma, dtype=torch.float64)
    assert (precond.c_in(s, SD) * x).var().item() == pytest.approx(1.0, abs=0.01)
    assert precond.f_target(x0, x, s, SD).var().item() == pytest.approx(1.0, abs=0.01)


def test_levels_are_equation_5_and_survive_the_vp_schedule():
    diffusion = EDMDiffusion(num_timesteps=1000, sigma_min=0.002, sigma_max=80.0, rho=7.0)
    sigmas = diffusion.sigmas64()
    assert sigmas[0].item() == pytest.approx(0.002, rel=1e-12) and sigmas[-1].item() == pytest.approx(80.0, rel=1e-12)
    i = 400  # eq. 5 indexes from sigma_max down: level t is step N - 1 - t
    step = 999 - i
    expected = (80 ** (1 / 7) + step / 999 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    assert sigmas[i].item() == pytest.approx(expected, rel=1e-12)
    assert bool((sigmas[1:] > sigmas[:-1]).all())
    alpha_bar = alpha_bar_from_betas(diffusion.betas64())  # what an export's scheduler computes (trained_betas)
    torch.testing.assert_close(((1 - alpha_bar) / alpha_bar).sqrt(), sigmas, rtol=1e-9, atol=0)
    torch.testing.assert_close(edm_sigmas(5, 1.0, 2.0, 1.0), torch.tensor([1.0, 1.25, 1.5, 1.75, 2.0]).double())


def test_training_noise_is_lognormal_and_rounds_to_the_nearest_level():
    torch.manual_seed(0)
    diffusion = EDMDiffusion(p_mean=-1.2, p_std=1.2)
    t = diffusion.sample_timesteps(200_000, torch.device("cpu"))
    log_sigma = diffusion.sigmas64()[t].log()
    assert log_sigma.mean().item() == pytest.approx(-1.2, abs=0.02)
    assert log_sigma.std().item() == pytest.approx(1.2, abs=0.02)
    queries = torch.linspace(-8, 6, 1001)  # beyond both ends too: clipped to the grid
    brute = (queries[:, None] - diffusion.log_sigmas[None]).abs().argmin(1)
    assert torch.equal(diffusion.nearest_level(queries), brute)


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        ({"sigma_min": 0.0}, r"sigma_min=0.0 must be > 0 \(EDM: 0.002\)"),
        ({"sigma_max": 0.001}, r"sigma_max=0.001 must be > sigma_min=0.002 \(EDM: 80\)"),
        ({"sigma_data": -1.0}, r"sigma_data=-1.0 must be > 0: the data's standard deviation"),
        ({"p_std": 0.0}, r"p_std=0.0 must be > 0 \(EDM: 1.2\)"),
        ({"p_uncond": 1.0}, r"p_uncond=1.0 must be in \[0, 1\)"),
        ({"num_timesteps": 1}, r"num_timesteps=1 must be >= 2"),
        ({"rho": 0.0}, r"rho=0.0 must be > 0 \(EDM: 7\)"),
    ],
)
def test_bad_values_are_refused_naming_the_argument(bad, refusal):
    """EDMDiffusion(...) names its own argument and the rule (plain torch: no Hydra key)."""
    with pytest.raises(ValueError, match=f"^{refusal}"):
        EDMDiffusion(**bad)


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        ({"sigma_max": 0.001}, r"diffusion\.sigma_max=0.001 must be > diffusion\.sigma_min=0.002 "),
        ({"p_uncond": 1.0}, r"diffusion\.p_uncond=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_values_name_the_key(bad, refusal):
    """Built from a run config's `diffusion:` node (as train.py builds it), the refusal names the diffusion.* keys."""
    cfg = OmegaConf.create({"diffusion": {"_target_": "ddpm.diffusion.edm.EDMDiffusion", **bad}})
    with pytest.raises(ValueError, match=f"^{refusal}"):
        build(cfg.diffusion)


def test_a_grid_outside_the_models_sigmas_is_refused():
    """sigma_min=200 on a linear-schedule model (largest sigma 157): the grid ran upwards, every level t = T - 1; with
    sigma_max=300 as well (the first refusal's advice then) every level was still t = T - 1, and below the smallest
    sigma (0.01) every level t = 0."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    sigmas = ((1 - alpha_bar_from_betas(betas)) / alpha_bar_from_betas(betas)).sqrt()
    refusal = r"^sigma_min={} and sigma_max={} leave no grid inside the model's sigmas \(0\.01\d* to 157\.\d+\)"
    for low, high, shown in [(200.0, None, ("200", r"157\.\d+")), (200.0, 300.0, ("200", "300")),
                             (0.005, 0.008, ("0.005", "0.008")), (None, 0.005, (r"0\.01\d*", "0.005"))]:  # fmt: skip
        with pytest.raises(ValueError, match=refusal.format(*shown)):
            EDMSampler(sigma_min=low, sigma_max=high).timesteps(sigmas)
    assert EDMSampler(steps=5, sigma_min=100.0, sigma_max=300.0).timesteps(sigmas)[-1] < 999  # a grid inside


def test_the_denoiser_recovers_x0_and_eps_from_the_exact_target():
    """A network that returns F* for known (x0, n) and checks its input is c_in x: the EDM denoiser's VP path gives
    back x0 and eps = n."""
    diffusion = EDMDiffusion(num_timesteps=200)
    t = torch.tensor([0, 50, 120, 199])
    sigma = diffusion.sigmas64()[t].view(-1, 1, 1, 1)
    g = torch.Generator().manual_seed(2)
    x0, n = torch.rand(4, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1, torch.randn(4, 1, 8, 8, generator=g)
    x = x0 + sigma * n.double()
    x_t = (x / (1 + sigma**2).sqrt()).float()  # the VP image the samplers hold

    def net(inp, steps, y):
        torch.testing.assert_close(inp.double(), x / (sigma**2 + SD**2).sqrt(), rtol=1e-5, atol=1e-6)
        return precond.f_target(x0, x, sigma, SD).float()

    d = diffusion.denoiser(net)
    out = d(x_t, d.sigmas[t], None)
    torch.testing.assert_close(out.x0.double(), x0, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.eps, n, rtol=0, atol=2e-3)  # (x - x0) / sigma: x0's float32 error over sigma_min


def ideal_gaussian_net(x, t, y):
    """F = 0: D(x; sigma) = c_skip x, the exact denoiser of data N(0, sigma_data^2)."""
    return torch.zeros_like(x)


def closed_form_x0(x_T: torch.Tensor, sigma_0: float) -> torch.Tensor:
    """x(0) of the flow from x_hat_0 = x_T sqrt(1 + sigma_0^2) (a VP x_T at sigma_0) for data N(0, sigma_data^2)."""
    return x_T.double() * math.sqrt(1 + sigma_0**2) * SD / math.sqrt(sigma_0**2 + SD**2)


def heun_by_hand(x: float, sigmas: list[float]) -> float:
    """Karras alg. 1 written out in float64 for dx/dsigma = sigma x / (sigma^2 + sigma_data^2), ending at 0."""
    f = lambda x, s: s * x / (s * s + SD * SD)  # noqa: E731
    for a, b in zip(sigmas, [*sigmas[1:], 0.0], strict=True):
        x_next = x + (b - a) * f(x, a)
        x = x + (b - a) * 0.5 * (f(x, a) + f(x_next, b)) if b > 0 else x_next
    return x


def test_heun_is_algorithm_1_and_converges_to_the_closed_form_flow():
    diffusion = EDMDiffusion()
    d = diffusion.denoiser(ideal_gaussian_net)
    x_T = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    errors = []
    for steps in (18, 200):
        sampler = EDMSampler(steps=steps, churn=0.0, clip_denoised=False)
        sigmas = diffusion.sigmas64()[sampler.timesteps(d.sigmas)].tolist()
        x0 = sampler.sample(d, x_T.clamp(-0.5, 0.5), d.sigmas, None).double()  # |x0| < 1: the final clamp is off
        by_hand = heun_by_hand(math.sqrt(1 + sigmas[0] ** 2), sigmas)  # the flow is linear in x: one number
        torch.testing.assert_close(x0, x_T.clamp(-0.5, 0.5).double() * by_hand, rtol=1e-5, atol=1e-6)
        exact = closed_form_x0(x_T.clamp(-0.5, 0.5), sigmas[0])
        errors.append(((x0 - exact).abs().max() / exact.abs().max()).item())
    assert errors[1] < 1e-3 < errors[0] < 0.1  # 5% at 18 steps (35 calls), 0.04% at 200: second order


def test_dpm_solver_on_edm_levels_converges_to_the_closed_form_flow():
    diffusion = EDMDiffusion()
    d = diffusion.denoiser(ideal_gaussian_net)
    x_T = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3)).clamp(-0.5, 0.5)
    errors = []
    for steps in (10, 100):
        sampler = DPMSolverSampler(steps=steps, clip_denoised=False)
        sigma_0 = diffusion.sigmas64()[sampler.timesteps(1000)[0]].item()
        exact = closed_form_x0(x_T, sigma_0)
        x0 = sampler.sample(d, x_T, d.sigmas, None).double()
        errors.append(((x0 - exact).abs().max() / exact.abs().max()).item())
    assert errors[1] < 2e-3 and errors[1] < errors[0] / 4


def test_generate_draws_the_same_images_from_f_as_from_the_equivalent_eps_network():
    """An independent second implementation: wrap the EDM network as an eps network by hand (eps = (x - D) / sigma
    from the precond formulas) and sample it as a DDPM-family model; the images equal generate()'s EDM path."""
    diffusion = EDMDiffusion(num_timesteps=100)
    net = tiny_unet(num_classes=3).eval()
    sigmas = diffusion.sigmas64()

    def as_eps(x_t, t, y):
        s = sigmas[t].view(-1, 1, 1, 1)
        x = x_t.double() * (1 + s**2).sqrt()
        f = net((x / (s**2 + SD**2).sqrt()).float(), t, y).double()
        d = SD**2 / (s**2 + SD**2) * x + s * SD / (s**2 + SD**2).sqrt() * f
        return ((x - d) / s).float()

    shared = dict(labels=torch.arange(6) % 3, seed=4, batch_size=6)
    as_ddpm = denoiser(as_eps, diffusion.betas64(), guidance=1.5, null_class=3)  # the levels as a DDPM schedule
    with torch.no_grad():
        ours = generate(denoiser_for(net, diffusion, guidance=1.5), DDIMSampler(steps=8), (6, 1, 8, 8), **shared).images
        theirs = generate(as_ddpm, DDIMSampler(steps=8), (6, 1, 8, 8), **shared).images
    assert (ours.int() - theirs.int()).abs().max() <= 1
    assert ((ours > 0) & (ours < 255)).float().mean() > 0.1  # not saturated: the comparison means something


def edm_run(folder, num_classes=3):
    diffusion = {
        "_target_": "ddpm.diffusion.edm.EDMDiffusion",
        "num_timesteps": 1000,
        "sigma_data": SD,
        "p_uncond": 0.1,
    }
    config = {"model": tiny_unet_config(num_classes), "diffusion": diffusion}
    net = tiny_unet(num_classes=num_classes)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return export_ema(folder / "ema.pt", net.state_dict(), config)


def test_export_adapter_gives_eps_and_diffusers_ddim_draws_our_images(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    import ddpm.weights.diffusers_adapter  # noqa: F401  (diffusers finds the adapter class once imported)
    from ddpm.weights.diffusers_folder import export_diffusers

    loaded = load_model(edm_run(tmp_path))
    folder = export_diffusers(loaded, tmp_path / "export")  # EDM: the adapter, with no adapter=True
    pipe = diffusers.DDIMPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    d = loaded.diffusion.denoiser(loaded.net)
    x_t, t = torch.randn(4, 1, 8, 8), torch.tensor([0, 300, 700, 999])
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(x_t, t).sample, d(x_t, d.sigmas[t], None).eps, rtol=1e-4, atol=1e-4)
    reloaded = load_model(folder)
    assert isinstance(reloaded.diffusion, EDMDiffusion) and reloaded.diffusion.sigma_data == SD
    pipe.save_pretrained(tmp_path / "resaved")  # diffusers' own save keeps no ddpm_config.json
    with pytest.raises(CheckpointError, match=r"EDM model .* lacks ddpm_config\.json"):
        load_model(tmp_path / "resaved")
    generator = torch.Generator().manual_seed(batch_seed(3, 0))
    images = pipe(batch_size=4, generator=generator, num_inference_steps=10, eta=0.0, use_clipped_model_output=True,
                  output_type="np").images  # fmt: skip
    ours = generate(denoiser_for(loaded.net, loaded.diffusion), DDIMSampler(steps=10), (4, 1, 8, 8), seed=3,
                    batch_size=4)  # fmt: skip
    theirs = (images * 255).round().astype(np.uint8)
    diff = np.abs(theirs.astype(int) - ours.images.permute(0, 2, 3, 1).numpy().astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.005
    assert to_uint8(torch.zeros(1)).item() == 128  # the scale both sides save in


def test_an_edm_run_of_model_diffusers_unet2d_exports_as_the_adapter_of_the_same_network(tmp_path):
    """model=diffusers_unet2d is our UNet under UNet2DModel's names: its EDM run exports as the adapter and gives
    the same eps as the run (before: refused, "only ddpm.models.unet.UNet can be exported as the adapter")."""
    pytest.importorskip("diffusers")
    from ddpm.models.diffusers_unet import DiffusersUNet2D
    from ddpm.weights.diffusers_folder import export_diffusers
    from ddpm.weights.torch_file import export_ema
    from ddpm.weights.unet2d_mapping import to_unet2d_state

    ours = load_model(edm_run(tmp_path))
    arguments = {k: v for k, v in ours.config["model"].items() if k not in ("_target_", "downsample")}
    wrapper = DiffusersUNet2D(**arguments)
    wrapper.unet.load_state_dict(to_unet2d_state(ours.net.state_dict(), ours.config["model"]))
    model = arguments | {"_target_": "ddpm.models.diffusers_unet.DiffusersUNet2D"}
    ema = export_ema(tmp_path / "wrapped" / "ema.pt", wrapper.state_dict(), ours.config | {"model": model})
    folder = export_diffusers(load_model(ema), tmp_path / "export")
    reloaded = load_model(folder)
    x_t, sigma, y = torch.randn(4, 1, 8, 8), torch.tensor([0.01, 0.5, 3.0, 60.0]), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        expected = ours.diffusion.denoiser(ours.net)(x_t, sigma, y).eps
        torch.testing.assert_close(reloaded.diffusion.denoiser(reloaded.net)(x_t, sigma, y).eps, expected)


@pytest.mark.slow
def test_train_sample_and_resume_with_diffusion_edm(tmp_path):
    """A real run: train.py diffusion=edm writes ema.pt whose config is EDM's; sample.py draws from it with EDM's
    Heun; a resume that changes diffusion.sigma_data is refused as a breaking change."""
    run_dir = tmp_path / "run"
    train("diffusion=edm", "model=unet_tiny", *TINY_RUN, f"hydra.run.dir={run_dir}")
    loaded = load_model(run_dir / "ema.pt")
    assert isinstance(loaded.diffusion, EDMDiffusion) and loaded.config["diffusion"]["sigma_data"] == SD
    result = sample(f"ckpt={run_dir / 'ema.pt'}", "sampler=edm", "sampler.steps=3", "num_samples=4",
                    f"output_dir={tmp_path / 'samples'}")  # fmt: skip
    assert (tmp_path / "samples" / "samples.npz").is_file(), result.stdout
    resumed = train("diffusion=edm", "model=unet_tiny", *TINY_RUN, "trainer.max_steps=9", "diffusion.sigma_data=0.3",
                    f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={tmp_path / 'r'}",
                    check=False)  # fmt: skip
    assert resumed.returncode != 0 and "diffusion.sigma_data" in resumed.stderr + resumed.stdout


@pytest.mark.slow
def test_edm_learns_16_real_digits_and_heun_draws_them():
    """The tiny UNet trained with EDMDiffusion.loss on 16 real 8x8 digits: its Heun samples (no guidance) lie near
    the training images (mean nearest-neighbour RMS distance well under that of the images to each other)."""
    torch.manual_seed(0)
    from ddpm.data.sources import DigitsSource

    x0 = DigitsSource().load(image_size=8, channels=1).images[:16].float() / 127.5 - 1.0  # (16, 1, 8, 8)
    net, diffusion = tiny_unet(), EDMDiffusion()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for _ in range(600):
        loss = diffusion.loss(net, x0, diffusion.sample_timesteps(16, x0.device), torch.randn_like(x0), None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    d = diffusion.denoiser(net.eval())
    x_T = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    samples = EDMSampler(steps=10).sample(d, x_T, d.sigmas, None)

    def nearest_rms(a, b, skip_self=False):
        d = torch.cdist(a.flatten(1), b.flatten(1)) / math.sqrt(64)
        if skip_self:
            d = d + torch.eye(len(a)) * 1e9
        return d.min(1).values.mean().item()

    between_digits = nearest_rms(x0, x0, skip_self=True)
    assert nearest_rms(samples, x0) < 0.5 * between_digits, (nearest_rms(samples, x0), between_digits)
