"""DDIM and DPM-Solver++: equivalence with diffusers' schedulers, the exact Gaussian ODE, guidance, NFE, configs.

diffusers (a dev dependency) is the reference implementation: the same network outputs go into its
DDPMScheduler, DDIMScheduler and DPMSolverMultistepScheduler, and every step's x must agree to float32
precision. Where diffusers misbehaves (DDIM's previous timestep under linspace or uneven trailing
spacing; a -1 timestep from trailing at some S), the reference is another diffusers scheduler that does
not, as said at each test.
"""

import math
import re

import numpy as np
import pytest
import torch
from helpers import CONF, compose, denoiser
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion.generate import generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.diffusion.samplers.spacing import interval_timesteps, step_timesteps
from ddpm.diffusion.schedule import make_betas

diffusers = pytest.importorskip("diffusers")

T = 1000
PREDICTION_TYPE = {"eps": "epsilon", "v": "v_prediction"}


def alpha_bar64(betas: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.cumprod(1 - betas.double().numpy()))  # float64, computed here


def toy_net(prediction: str, betas: torch.Tensor):
    """A fixed network whose x0 prediction moves from f = 1.5 sin(1.3 x + t / 500) at high noise (often outside
    [-1, 1], so clipping matters) to x at low noise, x0 = x + sqrt(1 - ab) (f - x), as a denoiser does (so eps
    stays O(1)); given as eps or v in float64 and returned in float32."""
    alpha_bar = alpha_bar64(betas)

    def net(x, t, y):
        a = alpha_bar[t].view(-1, 1, 1, 1)
        x = x.double()
        x0 = x + (1 - a).sqrt() * (1.5 * torch.sin(1.3 * x + t.view(-1, 1, 1, 1) / 500) - x)
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return (eps if prediction == "eps" else a.sqrt() * eps - (1 - a).sqrt() * x0).float()

    return net


def run_ours(sampler, net, betas, prediction, x_T, seed=None, **guided):
    """(every x the network saw, the returned x0) for one of our samplers."""
    seen = []

    def recording(x, t, y):
        seen.append(x.clone())
        return net(x, t, y)

    d = denoiser(recording, betas, prediction=prediction, **guided)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return seen, sampler.sample(d, x_T, d.sigmas, None, generator=generator)


def exact_schedule(scheduler, betas: torch.Tensor):
    """Give a diffusers scheduler (after set_timesteps) our float64 alpha_bar in place of its float32 one.

    diffusers keeps alpha_bar, and DPMSolverMultistepScheduler its sigmas, in float32, where 1 - alpha_bar near
    t = 0 keeps only ~3 significant digits (cosine beta_0 ~ 4e-5); its coefficients then differ from the exact
    ones by up to 1e-3 relative. With float64 tables its step functions (0-dim float64 coefficients times
    float32 tensors) compute the same algorithm from exact coefficients, as ours do.
    """
    alpha_bar = alpha_bar64(betas)
    scheduler.alphas_cumprod = alpha_bar
    if isinstance(scheduler, diffusers.DPMSolverMultistepScheduler):
        a = alpha_bar[scheduler.timesteps]
        scheduler.sigmas = torch.cat([((1 - a) / a).sqrt(), a.new_zeros(1)])  # final sigma 0
    return scheduler


def run_diffusers(scheduler, net, x_T, seed=None, **step_kwargs):
    """(every x the network saw, the final x clamped to [-1, 1]) for a diffusers scheduler."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    seen, x = [], x_T.clone()
    for t in scheduler.timesteps:
        seen.append(x.clone())
        output = net(x, torch.full((x.shape[0],), int(t)), None)
        x = scheduler.step(output, t, x, generator=generator, **step_kwargs).prev_sample
    return seen, x.clamp(-1, 1)


def assert_same_trajectory(ours, theirs) -> None:
    (seen, out), (their_seen, their_out) = ours, theirs
    assert len(seen) == len(their_seen)
    for i, (x, y) in enumerate(zip([*seen, out], [*their_seen, their_out], strict=True)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"step {i}: {m}")


def start(shape=(2, 1, 8, 8), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- timesteps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("steps_offset", [0, 1])
@pytest.mark.parametrize("num_timesteps", [1000, 50])
def test_timesteps_match_diffusers(spacing, steps_offset, num_timesteps):
    """For every S, our timesteps are DDIMScheduler's (step_timesteps) and DPMSolverMultistepScheduler's
    (interval_timesteps); where diffusers returns a -1 timestep (S + 1 entries) ours are its first S, and
    where it leaves 0..T-1 or repeats timesteps ours raise, saying which."""
    config = dict(num_train_timesteps=num_timesteps, timestep_spacing=spacing, steps_offset=steps_offset)
    references = [
        (step_timesteps, diffusers.DDIMScheduler(**config)),
        (interval_timesteps, diffusers.DPMSolverMultistepScheduler(**config)),
    ]
    for ours, scheduler in references:
        for steps in range(1, num_timesteps + 1):
            scheduler.set_timesteps(steps)
            theirs = scheduler.timesteps.tolist()
            if max(theirs) >= num_timesteps or min(theirs) < -1:
                refusal = rf"^spacing='{spacing}' with steps={steps} gives timesteps .* outside the model's 0\.\."
            elif len(set(theirs)) < len(theirs):
                refusal = rf"^spacing='{spacing}' repeats timesteps with steps={steps} and T={num_timesteps}"
            else:
                refusal = None
            if refusal is not None:
                with pytest.raises(ValueError, match=refusal):
                    ours(spacing, num_timesteps, steps, steps_offset=steps_offset)
                continue
            expected = theirs[:-1] if theirs[-1] == -1 else theirs
            assert ours(spacing, num_timesteps, steps, steps_offset=steps_offset).tolist() == expected, steps


def test_trailing_has_exactly_s_timesteps_where_diffusers_has_a_minus_one():
    """At T=1000, S=61 diffusers' trailing spacing (np.arange with a float step) has 62 entries, the last -1."""
    scheduler = diffusers.DDIMScheduler(timestep_spacing="trailing")
    scheduler.set_timesteps(61)
    assert len(scheduler.timesteps) == 62 and scheduler.timesteps[-1] == -1
    ours = step_timesteps("trailing", T, 61)
    assert len(ours) == 61 and ours[0] == T - 1 and ours[-1] == 15
    assert ours.tolist() == scheduler.timesteps[:-1].tolist()


# --- equivalence with diffusers ----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("eta", [0.0, 0.6])
@pytest.mark.parametrize(("spacing", "steps_offset"), [("trailing", 0), ("leading", 0), ("leading", 1)])
def test_ddim_matches_diffusers(schedule, prediction, clip, eta, spacing, steps_offset):
    """DDIM equals DDIMScheduler (trained_betas = ours, set_alpha_to_one, use_clipped_model_output) step by
    step, with the same noise for eta > 0. S = 10 divides T, where DDIMScheduler's previous timestep
    t - T // S is the next listed one."""
    betas, net = make_betas(schedule, T), toy_net(prediction, make_betas(schedule, T))
    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=T,
        trained_betas=betas.numpy(),
        clip_sample=clip,
        set_alpha_to_one=True,
        steps_offset=steps_offset,
        prediction_type=PREDICTION_TYPE[prediction],
        timestep_spacing=spacing,
    )
    scheduler.set_timesteps(10)
    sampler = DDIMSampler(steps=10, eta=eta, spacing=spacing, steps_offset=steps_offset, clip_denoised=clip)
    x_T = start()
    ours = run_ours(sampler, net, betas, prediction, x_T, seed=1)
    theirs = run_diffusers(exact_schedule(scheduler, betas), net, x_T, seed=1, eta=eta, use_clipped_model_output=True)
    assert_same_trajectory(ours, theirs)


def dpm_solver_scheduler(betas, prediction, clip, **config):
    """DPMSolverMultistepScheduler as DPM-Solver++ with our betas; clipping is its thresholding with
    sample_max_value=1 (the quantile is clamped to [1, 1], which is plain clipping to [-1, 1])."""
    return diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=T,
        trained_betas=betas.numpy(),
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
        thresholding=clip,
        sample_max_value=1.0,
        final_sigmas_type="zero",
        prediction_type=PREDICTION_TYPE[prediction],
        **config,
    )


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize(("spacing", "steps"), [("linspace", 50), ("trailing", 30), ("trailing", 7)])
def test_ddim_on_any_timesteps_matches_dpm_solver_first_order(schedule, prediction, clip, spacing, steps):
    """DDIM (eta=0) on linspace or uneven trailing timesteps, where DDIMScheduler steps to t - T // S instead of
    the next listed timestep (diffusers issue #12633), equals first-order DPM-Solver++ (Lu et al. 2022: DDIM
    is its first-order case) given the same timesteps, ending at sigma = 0."""
    betas, net = make_betas(schedule, T), toy_net(prediction, make_betas(schedule, T))
    sampler = DDIMSampler(steps=steps, spacing=spacing, clip_denoised=clip)
    scheduler = dpm_solver_scheduler(betas, prediction, clip, solver_order=1)
    scheduler.set_timesteps(timesteps=sampler.timesteps(T).tolist())
    x_T = start()
    assert_same_trajectory(
        run_ours(sampler, net, betas, prediction, x_T), run_diffusers(exact_schedule(scheduler, betas), net, x_T)
    )


@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("clip", [False, True])
def test_ddim_eta_one_matches_ddpm_scheduler(spacing, prediction, clip):
    """DDIM with eta = 1 is ancestral DDPM on its timesteps: it equals DDPMScheduler (fixed_small) given the
    same custom timesteps and the same noise."""
    betas = make_betas("linear", T)
    net = toy_net(prediction, betas)
    sampler = DDIMSampler(steps=25, eta=1.0, spacing=spacing, clip_denoised=clip)
    scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=T,
        trained_betas=betas.numpy(),
        variance_type="fixed_small",
        clip_sample=clip,
        prediction_type=PREDICTION_TYPE[prediction],
    )
    scheduler.set_timesteps(timesteps=sampler.timesteps(T).tolist())
    x_T = start()
    assert_same_trajectory(
        run_ours(sampler, net, betas, prediction, x_T, seed=3),
        run_diffusers(exact_schedule(scheduler, betas), net, x_T, seed=3),
    )


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [None, 100, 10])
@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
@pytest.mark.parametrize(("prediction", "clip"), [("eps", True), ("eps", False), ("v", True)])
def test_ddpm_matches_diffusers(schedule, steps, variance, prediction, clip):
    """DDPMSampler (all T or respaced) equals DDPMScheduler given the same timesteps and noise."""
    betas = make_betas(schedule, T)
    net = toy_net(prediction, betas)
    sampler = DDPMSampler(steps=steps, variance=variance, clip_denoised=clip)
    scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=T,
        trained_betas=betas.numpy(),
        variance_type=variance,
        clip_sample=clip,
        prediction_type=PREDICTION_TYPE[prediction],
    )
    scheduler.set_timesteps(timesteps=sampler.timesteps(T).flip(0).tolist())
    x_T = start((2, 1, 4, 4))
    assert_same_trajectory(
        run_ours(sampler, net, betas, prediction, x_T, seed=4),
        run_diffusers(exact_schedule(scheduler, betas), net, x_T, seed=4),
    )


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("steps", [8, 20])
def test_dpm_solver_matches_diffusers(schedule, prediction, clip, spacing, steps):
    """DPM-Solver++(2M) equals DPMSolverMultistepScheduler (dpmsolver++, order 2, midpoint, lower_order_final,
    final sigma 0) step by step, for its own timestep spacings."""
    betas = make_betas(schedule, T)
    net = toy_net(prediction, betas)
    scheduler = dpm_solver_scheduler(
        betas, prediction, clip, solver_order=2, lower_order_final=True, timestep_spacing=spacing
    )
    scheduler.set_timesteps(steps)
    sampler = DPMSolverSampler(steps=steps, spacing=spacing, clip_denoised=clip)
    x_T = start()
    assert_same_trajectory(
        run_ours(sampler, net, betas, prediction, x_T), run_diffusers(exact_schedule(scheduler, betas), net, x_T)
    )


@pytest.mark.parametrize("lower_order_final", [True, False])
@pytest.mark.parametrize(("order", "steps"), [(2, 8), (2, 20), (1, 20)])
def test_dpm_solver_final_step_is_first_order(lower_order_final, order, steps):
    """Into sigma = 0 the last step is first order whatever diffusers' lower_order_final says (it forces
    this for final_sigmas_type='zero'), so both settings give our trajectory; order=1 is solver_order=1."""
    betas = make_betas("cosine", T)
    net = toy_net("eps", betas)
    scheduler = dpm_solver_scheduler(
        betas, "eps", True, solver_order=order, lower_order_final=lower_order_final, timestep_spacing="trailing"
    )
    scheduler.set_timesteps(steps)
    sampler = DPMSolverSampler(steps=steps, order=order)
    x_T = start()
    assert_same_trajectory(
        run_ours(sampler, net, betas, "eps", x_T), run_diffusers(exact_schedule(scheduler, betas), net, x_T)
    )


# --- the exact answer for Gaussian data --------------------------------------------------------------

MU, S = 0.1, 0.4  # data x0 ~ N(MU, S^2) per pixel, well inside [-1, 1]


def gaussian_net(prediction: str, betas: torch.Tensor, inputs: list | None = None):
    """The exact network for x0 ~ N(MU, S^2): E[eps | x_t] = sqrt(1 - ab)(x_t - sqrt(ab) MU) / (ab S^2 + 1 - ab),
    and v = sqrt(ab) eps - sqrt(1 - ab) E[x0 | x_t], in float64."""
    alpha_bar = alpha_bar64(betas)

    def net(x, t, y):
        if inputs is not None:
            inputs.append(x.clone())
        a = alpha_bar[t].view(-1, 1, 1, 1)
        x = x.double()
        eps = (1 - a).sqrt() * (x - a.sqrt() * MU) / (a * S**2 + 1 - a)
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        return (eps if prediction == "eps" else a.sqrt() * eps - (1 - a).sqrt() * x0).float()

    return net


def exact_ode_solution(x_T: torch.Tensor, alpha_bar_T: float) -> torch.Tensor:
    """Where the probability-flow ODE takes x_T for Gaussian data: it keeps (x_t - sqrt(ab) MU) / sqrt(ab S^2 + 1 - ab)
    fixed, so x_0 = MU + S (x_T - sqrt(ab_T) MU) / sqrt(ab_T S^2 + 1 - ab_T)."""
    return MU + S * (x_T.double() - math.sqrt(alpha_bar_T) * MU) / math.sqrt(alpha_bar_T * S**2 + 1 - alpha_bar_T)


DETERMINISTIC = {
    "ddim": lambda steps: DDIMSampler(steps=steps, clip_denoised=False),
    "dpm_solver_order1": lambda steps: DPMSolverSampler(steps=steps, order=1, clip_denoised=False),
    "dpm_solver_2m": lambda steps: DPMSolverSampler(steps=steps, order=2, clip_denoised=False),
}


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_deterministic_samplers_converge_to_the_exact_ode_solution(schedule, name):
    """With the exact Gaussian model, DDIM and first-order DPM-Solver++ converge to the exact ODE solution at
    first order (error halves when the steps double), DPM-Solver++(2M) at second order (error falls >= 3.5x)."""
    betas = make_betas(schedule, T)
    x_T = torch.linspace(-2.0, 2.0, 256).view(4, 1, 8, 8)  # exact solution in [-0.7, 0.9]: no clamping
    exact = exact_ode_solution(x_T, float(alpha_bar64(betas)[-1]))
    errors = []
    for steps in (20, 40):
        d = denoiser(gaussian_net("eps", betas), betas)
        errors.append((DETERMINISTIC[name](steps).sample(d, x_T, d.sigmas, None).double() - exact).abs().max().item())
    if name == "dpm_solver_2m":
        assert errors[0] / errors[1] > 3.5 and errors[1] < 0.03, errors
    else:
        assert 1.7 < errors[0] / errors[1] < 2.3 and errors[1] < 0.1, errors


# Median and IQR / 1.349 estimate the mean and std without being moved by the final clamp to [-1, 1]. The
# std tolerance is each sampler's discretization error here: DDPM's fixed_small steps leave Var[x0 | x_t] out
# (low std, more so with fewer steps); a deterministic sampler's last step returns E[x0 | x_t] at its last
# timestep, whose std is S sqrt(ab S^2 / (ab S^2 + 1 - ab)) (-8% at t=49 on the linear schedule).
DISTRIBUTION_CASES = {
    "ddpm_all_T": (lambda: DDPMSampler(clip_denoised=False), 0.03),
    "ddpm_respaced_100": (lambda: DDPMSampler(steps=100, clip_denoised=False), 0.10),
    "ddim_50": (lambda: DDIMSampler(steps=50, clip_denoised=False), 0.10),
    "ddim_50_eta1": (lambda: DDIMSampler(steps=50, eta=1.0, clip_denoised=False), 0.16),
    "ddim_200_linspace": (lambda: DDIMSampler(steps=200, spacing="linspace", clip_denoised=False), 0.03),
    "dpm_solver_20": (lambda: DPMSolverSampler(steps=20, clip_denoised=False), 0.10),
    "dpm_solver_50_linspace": (lambda: DPMSolverSampler(steps=50, spacing="linspace", clip_denoised=False), 0.04),
}


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("name", sorted(DISTRIBUTION_CASES))
def test_samplers_land_on_the_data_distribution(schedule, name):
    """With the exact model for x0 ~ N(MU, S^2), 65536 sampled pixels have median MU (within 0.008, 4x its
    standard error 1.25 S / 256) and IQR-based std S within the sampler's stated relative tolerance."""
    make, tolerance = DISTRIBUTION_CASES[name]
    betas = make_betas(schedule, T)
    generator = torch.Generator().manual_seed(5)
    x_T = torch.randn((4096, 1, 4, 4), generator=generator)
    d = denoiser(gaussian_net("eps", betas), betas)
    out = make().sample(d, x_T, d.sigmas, None, generator=generator).double().flatten()
    q1, median, q3 = torch.quantile(out, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    assert abs(median - MU) < 0.008
    assert abs((q3 - q1) / 1.34898 / S - 1) < tolerance, (q3 - q1) / 1.34898


SAMPLERS = {
    "ddpm_respaced": lambda: DDPMSampler(steps=50, clip_denoised=False),
    "ddim": lambda: DDIMSampler(steps=20, clip_denoised=False),
    "ddim_eta": lambda: DDIMSampler(steps=20, eta=0.5, clip_denoised=False),
    "dpm_solver": lambda: DPMSolverSampler(steps=20, clip_denoised=False),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_v_model_equals_eps_model(name):
    """The exact Gaussian model given as v or as eps gives the same trajectory (same noise). Linear schedule:
    at the cosine schedule's t = T-1 (alpha_bar ~ 2e-9) a float32 eps fixes x0 only to ~1e-3."""
    betas = make_betas("linear", T)
    runs = []
    for prediction in ("eps", "v"):
        inputs = []
        d = denoiser(gaussian_net(prediction, betas, inputs), betas, prediction=prediction)
        x_T, generator = start((4, 1, 8, 8)), torch.Generator().manual_seed(6)
        out = SAMPLERS[name]().sample(d, x_T, d.sigmas, None, generator=generator)
        runs.append([*inputs, out])
    for x_eps, x_v in zip(*runs, strict=True):
        torch.testing.assert_close(x_v, x_eps, rtol=1e-5, atol=1e-5)


# --- internal consistency ----------------------------------------------------------------------------


def test_ddim_eta_one_on_all_timesteps_is_ddpm_sampler():
    """DDIM on all T timesteps with eta = 1 is ancestral DDPM (fixed_small): same noise, same trajectory."""
    betas = make_betas("linear", T)
    net, x_T = toy_net("eps", betas), start((2, 1, 4, 4))
    ddim = run_ours(DDIMSampler(steps=T, eta=1.0), net, betas, "eps", x_T, seed=7)
    ddpm = run_ours(DDPMSampler(), net, betas, "eps", x_T, seed=7)
    assert_same_trajectory(ddim, ddpm)


def test_dpm_solver_order_one_is_ddim():
    """First-order DPM-Solver++ on the same (trailing) timesteps is DDIM with eta = 0 (Lu et al. 2022)."""
    betas = make_betas("cosine", T)
    net, x_T = toy_net("v", betas), start()
    ddim = run_ours(DDIMSampler(steps=15), net, betas, "v", x_T)
    dpm = run_ours(DPMSolverSampler(steps=15, order=1), net, betas, "v", x_T)
    assert_same_trajectory(ddim, dpm)


# --- guidance, NFE, determinism, precision -----------------------------------------------------------


def conditional_net(x, t, y):
    """Outputs that differ with the label, including the null label 10."""
    return 0.5 * x + 0.02 * y.view(-1, 1, 1, 1).float() * torch.cos(x + t.view(-1, 1, 1, 1) / 300)


class CountingNet:
    def __init__(self, net):
        self.net, self.batch_sizes = net, []

    def __call__(self, x, t, y):
        self.batch_sizes.append(x.shape[0])
        return self.net(x, t, y)


@pytest.mark.parametrize(
    "make", [lambda: DDIMSampler(steps=12, eta=0.3), lambda: DPMSolverSampler(steps=12)], ids=["ddim", "dpm_solver"]
)
def test_guidance_is_one_batched_forward_per_step(make):
    """Guided sampling with w: S forwards on [cond; uncond] (2B images), nfe = S, and the same images as an
    unguided run on a network that outputs (1 + w) out(y) - w out(null) itself."""
    betas, w, null = make_betas("linear", T), 2.0, 10
    y, x_T = torch.tensor([0, 3, 7]), start((3, 1, 4, 4))
    counting = CountingNet(conditional_net)
    guided = denoiser(counting, betas, guidance=w, null_class=null)
    out = make().sample(guided, x_T, guided.sigmas, y, generator=torch.Generator().manual_seed(8))
    assert counting.batch_sizes == [6] * 12 and guided.calls == 12

    def mixed(x, t, labels):
        return (1 + w) * conditional_net(x, t, labels) - w * conditional_net(x, t, torch.full_like(labels, null))

    plain = denoiser(mixed, betas, null_class=null)
    expected = make().sample(plain, x_T, plain.sigmas, y, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    unguided = denoiser(conditional_net, betas)
    assert not torch.allclose(out, make().sample(unguided, x_T, unguided.sigmas, y))


def run_generate(sampler, seed):
    betas = make_betas("linear", T)
    return generate(denoiser(toy_net("eps", betas), betas), sampler, (6, 1, 4, 4), batch_size=4, seed=seed)


@pytest.mark.parametrize(
    ("sampler", "nfe"), [(DDIMSampler(steps=7, eta=0.5), 7), (DPMSolverSampler(steps=5), 5)], ids=["ddim", "dpm"]
)
def test_generate_reports_nfe_and_is_seeded(sampler, nfe):
    """generate() reports S network evaluations per batch; the same seed gives the same images, another seed
    other images."""
    first, again, other = run_generate(sampler, 1), run_generate(sampler, 1), run_generate(sampler, 2)
    assert first.nfe == nfe
    assert torch.equal(first.images, again.images) and not torch.equal(first.images, other.images)


def test_float32_throughout():
    """A float64 x_T still runs the loop in float32: the network sees float32 and the result is float32."""
    betas = make_betas("linear", T)
    for sampler in (DDIMSampler(steps=4, eta=1.0), DPMSolverSampler(steps=4)):
        seen, out = run_ours(sampler, toy_net("eps", betas), betas, "eps", start().double(), seed=0)
        assert {x.dtype for x in seen} == {torch.float32} and out.dtype == torch.float32
        assert out.abs().max() <= 1


# --- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "cls"), [("ddim", DDIMSampler), ("dpm_solver", DPMSolverSampler)])
def test_sampler_config_instantiates_with_overrides(name, cls, tmp_path):
    """`sample.py sampler=NAME sampler.steps=50` composes and builds the sampler; every key has a comment."""
    cfg = compose("sample", [f"sampler={name}", "sampler.steps=50", f"output_dir={tmp_path}"])
    sampler = instantiate(cfg.sampler)
    assert isinstance(sampler, cls) and sampler.steps == 50 and len(sampler.timesteps(T)) == 50
    lines = (CONF / "sampler" / f"{name}.yaml").read_text().splitlines()
    keys = [line for line in lines if line and not line.startswith(("#", "_target_"))]
    assert keys and all("#" in line for line in keys)


DDIM, DPM = DDIMSampler, DPMSolverSampler
BAD_SETTINGS = [  # (class, arguments, the refusal; {key} is where the Hydra key goes: "" in plain torch)
    (DDIM, dict(spacing="uniform"), "{key}spacing='uniform' is unknown; use one of ['leading', 'linspace', "),
    (DDIM, dict(steps=0), "{key}steps=0 must be >= 1"),
    (DDIM, dict(eta=-0.1), "{key}eta=-0.1 must be >= 0"),
    (DDIM, dict(steps_offset=-1), "{key}steps_offset=-1 must be >= 0"),
    (
        DDIM,
        dict(steps=1, spacing="linspace"),
        "{key}spacing='linspace' with {key}steps=1 evaluates the network only at t=0,",
    ),
    (
        DDIM,
        dict(steps=1, spacing="leading", steps_offset=1),
        "{key}spacing='leading' with {key}steps=1 evaluates the network only at t=1,",
    ),
    (DPM, dict(order=3), "{key}order=3 is unsupported; use 2 (DPM-Solver++ 2M) or 1"),
    (DPM, dict(spacing="quadratic"), "{key}spacing='quadratic' is unknown; use one of ['leading', "),
]


@pytest.mark.parametrize(("cls", "arguments", "refusal"), BAD_SETTINGS)
def test_bad_settings_name_the_argument_and_built_from_a_config_the_key(cls, arguments, refusal):
    """A bad setting is refused at construction: plain torch names its own argument (no Hydra key); built from a
    config node at `sampler` (ddpm.config.build), the same refusal names the key the user sets, sampler.*."""
    with pytest.raises(ValueError, match="^" + re.escape(refusal.format(key=""))):
        cls(**arguments)
    target = f"{cls.__module__}.{cls.__qualname__}"
    cfg = OmegaConf.create({"sampler": {"_target_": target, **arguments}})
    with pytest.raises(ValueError, match="^" + re.escape(refusal.format(key="sampler."))):
        build(cfg.sampler)


def test_a_nested_sampler_node_is_named_by_its_full_key():
    """The training-time grid's sampler sits at callbacks.sample_grid.sampler: that whole key is named."""
    node = {"_target_": "ddpm.diffusion.samplers.ddim.DDIMSampler", "steps": 0}
    cfg = OmegaConf.create({"callbacks": {"sample_grid": {"sampler": node}}})
    with pytest.raises(ValueError, match=r"^callbacks\.sample_grid\.sampler\.steps=0 must be >= 1$"):
        build(cfg.callbacks.sample_grid.sampler)


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        (lambda: DDIMSampler(steps=T + 1), r"^steps=1001 must be between 1 and the model's T=1000; set steps to at"),
        (
            lambda: DDIMSampler(steps=T, spacing="leading", steps_offset=1),
            r"^spacing='leading' with steps=1000 gives timesteps \[1000, 999, 998\]\.\.\., outside the model's "
            r"0\.\.999; lower steps_offset or steps",
        ),
        (
            lambda: DPMSolverSampler(steps=T, spacing="linspace"),
            r"^spacing='linspace' repeats timesteps with steps=1000 and T=1000; use fewer steps",
        ),
    ],
)
def test_settings_the_model_cannot_take_are_refused_when_its_t_is_known(make, refusal):
    """Settings that only fail against the model's T (known at sampling, not at construction) are refused by
    timesteps(T), naming the argument to change."""
    sampler = make()
    with pytest.raises(ValueError, match=refusal):
        sampler.timesteps(T)
