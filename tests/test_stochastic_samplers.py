"""SDE-DPM-Solver++(2M), EDM's stochastic Heun and Restart: references, the exact Gaussian answer, NFE, seeds, configs.

References are independent of the code under test: diffusers' DPMSolverMultistepScheduler (sde-dpmsolver++) for
DPMSolverSDESampler, and Karras et al. 2022 algorithms 1-2 and Xu et al. 2023 algorithm 1 written here in float64,
with EDM's iDDPM denoiser D(x; sigma) = x - sigma eps(x / sqrt(1 + sigma^2), t) and round_sigma, for EDMSampler
and RestartSampler.
"""

import itertools
import math
import re

import numpy as np
import pytest
import torch
from helpers import CONF, compose, denoiser
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.diffusion.samplers.dpm_solver_sde import DPMSolverSDESampler
from ddpm.diffusion.samplers.edm import EDMSampler
from ddpm.diffusion.samplers.restart import RestartSampler
from ddpm.diffusion.schedule import make_betas

diffusers = pytest.importorskip("diffusers")

T = 1000
PREDICTION_TYPE = {"eps": "epsilon", "v": "v_prediction"}


def alpha_bar64(betas: torch.Tensor) -> np.ndarray:
    return np.cumprod(1 - betas.double().numpy())  # float64, computed here


def toy_net(prediction: str, betas: torch.Tensor, seen: list | None = None):
    """A fixed network whose x0 moves from 1.5 sin(1.3 x + t / 500) at high noise (often outside [-1, 1]) to x at
    low noise, given as eps or v in float32; records (t, x) of every call in `seen`."""
    alpha_bar = torch.from_numpy(alpha_bar64(betas))

    def net(x, t, y):
        if seen is not None:
            seen.append((int(t[0]), x.clone()))
        a = alpha_bar[t].view(-1, 1, 1, 1)
        x = x.double()
        x0 = x + (1 - a).sqrt() * (1.5 * torch.sin(1.3 * x + t.view(-1, 1, 1, 1) / 500) - x)
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return (eps if prediction == "eps" else a.sqrt() * eps - (1 - a).sqrt() * x0).float()

    return net


def start(shape=(2, 1, 8, 8), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- SDE-DPM-Solver++(2M) against diffusers ----------------------------------------------------------


def run_diffusers_sde(betas, net, prediction, clip, spacing, steps, x_T, seed):
    """DPMSolverMultistepScheduler(sde-dpmsolver++, 2M midpoint, final sigma 0) with float64 tables (diffusers keeps
    them in float32; see test_fast_samplers.exact_schedule) and, as variance_noise, the draws our sampler makes from
    the same seed: one (B, C, H, W) tensor per step but the last, whose noise coefficient is 0."""
    scheduler = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=T,
        trained_betas=betas.numpy(),
        algorithm_type="sde-dpmsolver++",
        solver_order=2,
        solver_type="midpoint",
        thresholding=clip,
        sample_max_value=1.0,  # thresholding at quantile clamped to [1, 1] is clipping to [-1, 1]
        final_sigmas_type="zero",
        prediction_type=PREDICTION_TYPE[prediction],
        timestep_spacing=spacing,
    )
    scheduler.set_timesteps(steps)
    alpha_bar = torch.from_numpy(alpha_bar64(betas))
    a = alpha_bar[scheduler.timesteps]
    scheduler.alphas_cumprod = alpha_bar
    scheduler.sigmas = torch.cat([((1 - a) / a).sqrt(), a.new_zeros(1)])
    generator = torch.Generator().manual_seed(seed)
    noises = [torch.randn(x_T.shape, generator=generator) for _ in range(steps - 1)] + [torch.zeros_like(x_T)]
    x = x_T.clone()
    for t, noise in zip(scheduler.timesteps, noises, strict=True):
        output = net(x, torch.full((x.shape[0],), int(t)), None)
        x = scheduler.step(output, t, x, variance_noise=noise).prev_sample
    return x.clamp(-1, 1)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize(("spacing", "steps"), [("trailing", 20), ("linspace", 8), ("leading", 12)])
def test_dpm_solver_sde_matches_diffusers(schedule, prediction, clip, spacing, steps):
    """Every network input and the output equal diffusers' sde-dpmsolver++ (order 2, midpoint) fed the same noise."""
    betas = make_betas(schedule, T)
    ours_seen, theirs_seen = [], []
    sampler = DPMSolverSDESampler(steps=steps, spacing=spacing, clip_denoised=clip)
    d = denoiser(toy_net(prediction, betas, ours_seen), betas, prediction=prediction)
    out = sampler.sample(d, start(), d.sigmas, None, generator=torch.Generator().manual_seed(3))
    theirs = run_diffusers_sde(
        betas, toy_net(prediction, betas, theirs_seen), prediction, clip, spacing, steps, start(), 3
    )
    assert [t for t, _ in ours_seen] == [t for t, _ in theirs_seen]
    for i, ((_, x), (_, y)) in enumerate(zip(ours_seen, theirs_seen, strict=True)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"step {i}: {m}")
    torch.testing.assert_close(out, theirs, rtol=1e-5, atol=1e-5)


# --- EDM and Restart against the papers' algorithms ---------------------------------------------------


class Reference:
    """Karras et al. 2022 algorithms 1-2 and Xu et al. 2023 algorithm 1 in float64, as EDM runs iDDPM models."""

    def __init__(self, net, betas, clip=False, rho=7.0):
        self.net, self.clip, self.rho, self.seen = net, clip, rho, []
        self.alpha_bar = alpha_bar64(betas)
        self.table = np.sqrt((1 - self.alpha_bar) / self.alpha_bar)  # discrete sigmas, (T,)

    def nearest(self, sigma: float) -> int:  # EDM's round_sigma, as a timestep
        return int(np.abs(self.table - sigma).argmin())

    def grid(self, sigma_min: float, sigma_max: float, n: int) -> list[int]:  # eq. 5, rounded
        i = np.arange(n) / max(n - 1, 1)
        sigmas = (
            sigma_max ** (1 / self.rho) + i * (sigma_min ** (1 / self.rho) - sigma_max ** (1 / self.rho))
        ) ** self.rho
        return [self.nearest(s) for s in sigmas]

    def denoise(self, x: torch.Tensor, t: int) -> torch.Tensor:  # iDDPMPrecond: c_in = 1/sqrt(1+s^2), c_out = -s
        self.seen.append(t)
        sigma = self.table[t]
        eps = self.net((x / math.sqrt(1 + sigma**2)).float(), torch.full((x.shape[0],), t), None).double()
        d = x - sigma * eps
        return d.clamp(-1, 1) if self.clip else d

    def heun(self, x: torch.Tensor, t: int, t_next: int | None) -> torch.Tensor:  # algorithm 1, lines 4-8
        s, s_next = self.table[t], 0.0 if t_next is None else self.table[t_next]
        d = (x - self.denoise(x, t)) / s
        x_next = x + (s_next - s) * d
        if t_next is None:
            return x_next
        return x + (s_next - s) * (d / 2 + (x_next - self.denoise(x_next, t_next)) / s_next / 2)

    def edm(self, x_T, steps, churn=0.0, s_tmin=0.0, s_tmax=math.inf, s_noise=1.0, generator=None, restart=None):
        grid = self.grid(self.table[0], self.table[-1], steps)
        x = x_T.double() / math.sqrt(self.alpha_bar[grid[0]])  # x_T is x_t at sigma_0's timestep
        for i, t in enumerate(grid):
            gamma = min(churn / steps, math.sqrt(2) - 1) if s_tmin <= self.table[t] <= s_tmax else 0.0
            if gamma > 0:  # algorithm 2, lines 5-7: churn up to the rounded sigma_hat
                t_hat = self.nearest(self.table[t] * (1 + gamma))
                z = torch.randn(x.shape, generator=generator).double()
                x = x + math.sqrt(self.table[t_hat] ** 2 - self.table[t] ** 2) * s_noise * z
                t = t_hat
            x = self.heun(x, t, grid[i + 1] if i + 1 < steps else None)
            if restart is not None and i + 1 == 1 + int(np.abs(self.table[grid[1:]] - restart["t_min"]).argmin()):
                x = self.restarts(x, grid[i + 1], generator=generator, **restart)
        return x.clamp(-1, 1)

    def restarts(self, x, t_min_step, *, t_min, t_max, restarts, restart_steps, generator):  # Xu et al. algorithm 1
        backward = self.grid(self.table[t_min_step], t_max, restart_steps + 1)
        for _ in range(restarts):
            z = torch.randn(x.shape, generator=generator).double()
            x = x + math.sqrt(self.table[backward[0]] ** 2 - self.table[t_min_step] ** 2) * z
            for t, t_next in itertools.pairwise(backward):
                x = self.heun(x, t, t_next)
        return x


# Our float32 loop against the float64 reference: cosine's sigma_max ~ 2e4 puts x_hat ~ 2e4 x_T, where float32
# D = x_hat - sigma eps keeps ~1e-4 absolute, and N=5 then steps from sigma 641 to 0.006 in one Heun step, whose
# correction scales D's error by up to ~1e5 before the clipped final D (up to 8e-4 seen). Linear: sigma_max 157.
ATOL = {"linear": 1e-4, "cosine": 1.5e-3}


def run_ours(sampler, net, betas, x_T, seed=7):
    seen = []
    d = denoiser(lambda x, t, y: (seen.append(int(t[0])), net(x, t, y))[1], betas)
    out = sampler.sample(d, x_T, d.sigmas, None, generator=torch.Generator().manual_seed(seed))
    return seen, out, d.calls


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize(
    "settings",
    [
        dict(steps=13),
        dict(steps=5),
        dict(steps=13, churn=40.0, s_tmin=0.05, s_tmax=50.0, s_noise=1.003),
        dict(steps=18, churn=3.0),
    ],
    ids=["heun13", "heun5", "churn_capped", "churn_small"],
)
def test_edm_matches_karras_algorithm(schedule, clip, settings):
    """EDMSampler visits the reference's timesteps (rounded grid and rounded sigma_hat), makes 2N - 1 network calls
    and returns the reference's images, given the same noise for the churn."""
    betas = make_betas(schedule, T)
    net, x_T = toy_net("eps", betas), start()
    seen, out, nfe = run_ours(EDMSampler(clip_denoised=clip, **settings), net, betas, x_T)
    reference = Reference(net, betas, clip=clip)
    expected = reference.edm(x_T, generator=torch.Generator().manual_seed(7), **settings)
    assert seen == reference.seen and nfe == 2 * settings["steps"] - 1
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=ATOL[schedule])


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize(
    "settings",
    [dict(steps=9), dict(steps=12, restarts=3, restart_steps=3, t_min=0.3, t_max=2.0)],
    ids=["defaults", "three_cycles"],
)
def test_restart_matches_xu_algorithm(schedule, settings):
    """RestartSampler equals Heun with K restart cycles written from Xu et al. 2023, algorithm 1, same noise."""
    betas = make_betas(schedule, T)
    net, x_T = toy_net("eps", betas), start()
    sampler = RestartSampler(clip_denoised=False, **settings)
    seen, out, nfe = run_ours(sampler, net, betas, x_T)
    reference = Reference(net, betas)
    restart = dict(
        t_min=sampler.t_min, t_max=sampler.t_max, restarts=sampler.restarts, restart_steps=sampler.restart_steps
    )
    expected = reference.edm(x_T, sampler.steps, generator=torch.Generator().manual_seed(7), restart=restart)
    assert seen == reference.seen and nfe == sampler.network_evaluations()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=ATOL[schedule])


@pytest.mark.parametrize(("schedule", "sigma_max"), [("linear", None), ("cosine", 80.0)])
def test_restart_without_cycles_is_deterministic_heun(schedule, sigma_max):
    """restarts=0 is EDMSampler with churn=0 on the same N and sigma_max (a cosine model's largest sigma is 2e4,
    where a 9-step grid spends most of its steps: sigma_max=80 there, as EDM): the same images and timesteps."""
    betas = make_betas(schedule, T)
    net, x_T = toy_net("v", betas), start()
    heun = run_ours(EDMSampler(steps=9, sigma_max=sigma_max), net, betas, x_T)
    restart = run_ours(RestartSampler(steps=9, restarts=0, sigma_max=sigma_max), net, betas, x_T)
    assert heun[0] == restart[0] and heun[2] == restart[2] == 17
    torch.testing.assert_close(restart[1], heun[1], rtol=0, atol=0)


# --- the exact answer for Gaussian data --------------------------------------------------------------

MU, S = 0.3, 0.2  # data x0 ~ N(MU, S^2) per pixel; [-1, 1] is 3.5 S away from MU, so the final clamp is negligible


def gaussian_net(betas: torch.Tensor, seen: list):
    """The exact eps predictor for x0 ~ N(MU, S^2) under the VP schedule: from E[x0 | x_t] = MU + sqrt(ab) S^2
    (x_t - sqrt(ab) MU) / (ab S^2 + 1 - ab), E[eps | x_t] = sqrt(1 - ab) (x_t - sqrt(ab) MU) / (ab S^2 + 1 - ab)."""
    alpha_bar = torch.from_numpy(alpha_bar64(betas))

    def net(x, t, y):
        seen.append(int(t[0]))
        a = alpha_bar[t].view(-1, 1, 1, 1)
        return ((1 - a).sqrt() * (x.double() - a.sqrt() * MU) / (a * S**2 + 1 - a)).float()

    return net


# Settings fine enough that discretization error stays under ~1.5% of S (the defaults' few steps leave 10-30% on
# this narrow Gaussian, mostly Heun's overshoot where sigma ~ S). The tolerance is on std / expected, where expected
# is the std of E[x0 | x_t] at the last timestep the network sees: what an exact sampler returns (a last step into
# sigma = 0 returns the denoised x0). Checked by breaking the code: SDE noise sqrt(1 - e^-h), ratio without e^-h,
# phi = alpha (1 - e^-h), 2M weights 1/r; EDM churn noise (sigma_hat - sigma), x_t = 1.01 x_hat sqrt(ab); restart
# jump sigma_max instead of sqrt(t_max^2 - t_min^2): each fails here (the reference tests catch the smaller ones).
DISTRIBUTION_CASES = {
    "ddpm_all_T": (lambda: DDPMSampler(clip_denoised=False), 0.03),  # the control: ancestral sampling
    "dpm_solver_sde_500": (lambda: DPMSolverSDESampler(steps=500, clip_denoised=False), 0.02),
    "edm_100_heun": (lambda: EDMSampler(steps=100, clip_denoised=False), 0.02),
    "edm_100_churn": (
        lambda: EDMSampler(steps=100, churn=40, s_tmin=0.05, s_tmax=50, s_noise=1.0, clip_denoised=False),
        0.03,
    ),
    "restart": (lambda: RestartSampler(steps=20, restarts=5, restart_steps=4, clip_denoised=False), 0.025),
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTION_CASES))
def test_samplers_land_on_the_gaussian_data(name):
    """With the exact network for x0 ~ N(MU, S^2), 65536 sampled pixels have mean MU (within 0.005, 6x its standard
    error S / 256) and the std an exact sampler would give within the case's relative tolerance."""
    make, tolerance = DISTRIBUTION_CASES[name]
    betas, seen = make_betas("linear", T), []
    generator = torch.Generator().manual_seed(5)
    x_T = torch.randn((4096, 1, 4, 4), generator=generator)
    d = denoiser(gaussian_net(betas, seen), betas)
    out = make().sample(d, x_T, d.sigmas, None, generator=generator)
    a = alpha_bar64(betas)[seen[-1]]
    expected = S * math.sqrt(a * S**2 / (a * S**2 + 1 - a))  # std of E[x0 | x_t] for x_t ~ q(x_t) at the last call
    out = out.double()
    assert abs(out.mean().item() - MU) < 0.005, out.mean().item()
    assert abs(out.std().item() / expected - 1) < tolerance, (out.std().item(), expected)


# --- NFE, seeds, precision, validation, configuration ------------------------------------------------

NFE_CASES = {
    "sde_20": (lambda: DPMSolverSDESampler(steps=20), 20),
    "sde_1": (lambda: DPMSolverSDESampler(steps=1), 1),
    "edm_13": (lambda: EDMSampler(steps=13), 25),
    "edm_13_churn": (lambda: EDMSampler(steps=13, churn=40, s_tmin=0.05, s_tmax=50), 25),
    "edm_1": (lambda: EDMSampler(steps=1), 1),
    "restart_default": (lambda: RestartSampler(), 25),
    "restart_k3": (lambda: RestartSampler(steps=6, restarts=3, restart_steps=1, t_min=0.5, t_max=3.0), 17),
    "restart_k0": (lambda: RestartSampler(steps=4, restarts=0), 7),
}


@pytest.mark.parametrize("name", sorted(NFE_CASES))
def test_network_evaluations_is_what_the_model_counts(name):
    """network_evaluations() is the number of network calls the denoiser counts for one batch (and the stated
    NFE)."""
    make, nfe = NFE_CASES[name]
    betas = make_betas("linear", T)
    sampler = make()
    _, _, counted = run_ours(sampler, toy_net("eps", betas), betas, start((2, 1, 4, 4)))
    assert sampler.network_evaluations() == counted == nfe


STOCHASTIC = {
    "dpm_solver_sde": lambda: DPMSolverSDESampler(steps=10),
    "edm_churn": lambda: EDMSampler(steps=6, churn=10),
    "restart": lambda: RestartSampler(steps=6, t_min=0.3, t_max=1.0),
}


@pytest.mark.parametrize("name", sorted(STOCHASTIC))
def test_same_seed_same_images_float32(name):
    """The same generator seed gives identical images, another seed other images; the network sees float32 even
    from a float64 x_T, and the output is float32 in [-1, 1]."""
    betas = make_betas("linear", T)
    x_T = start((2, 1, 4, 4)).double()
    inputs = []
    runs = [run_ours(STOCHASTIC[name](), toy_net("eps", betas, inputs), betas, x_T, seed=s)[1] for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert {x.dtype for _, x in inputs} == {torch.float32} and runs[0].dtype == torch.float32
    assert runs[0].abs().max() <= 1


SDE, EDM, RESTART = DPMSolverSDESampler, EDMSampler, RestartSampler
BAD_SETTINGS = [  # (class, arguments, the refusal; {key} is where the Hydra key goes: "" in plain torch)
    (SDE, dict(steps=0), "{key}steps=0 must be >= 1"),
    (SDE, dict(spacing="quadratic"), "{key}spacing='quadratic' is unknown; use one of ['leading', "),
    (SDE, dict(steps_offset=-1), "{key}steps_offset=-1 must be >= 0"),
    (EDM, dict(steps=0), "{key}steps=0 must be >= 1"),
    (EDM, dict(churn=-1), "{key}churn=-1 must be >= 0"),
    (EDM, dict(s_noise=-0.5), "{key}s_noise=-0.5 must be >= 0"),
    (EDM, dict(rho=0), "{key}rho=0 must be > 0"),
    (EDM, dict(s_tmin=2.0, s_tmax=1.0), "{key}s_tmin=2.0 must be <= {key}s_tmax=1.0"),
    (EDM, dict(sigma_min=0.0), "{key}sigma_min=0.0 must be > 0, or null for the model's"),
    (EDM, dict(sigma_min=1.0, sigma_max=0.5), "{key}sigma_max=0.5 must be > sigma_min"),
    (RESTART, dict(steps=1), "{key}steps=1 must be >= 2"),
    (RESTART, dict(restart_steps=0), "{key}restart_steps=0 must be >= 1"),
    (RESTART, dict(restarts=-1), "{key}restarts=-1 must be >= 0"),
    (RESTART, dict(t_min=0.5, t_max=0.3), "{key}t_min=0.5 must be > 0 and < {key}t_max=0.3"),
    (RESTART, dict(s_noise=-1), "{key}s_noise=-1 must be >= 0"),
    (RESTART, dict(rho=-7), "{key}rho=-7 must be > 0"),
]


@pytest.mark.parametrize(("cls", "arguments", "refusal"), BAD_SETTINGS)
def test_bad_settings_name_the_argument_and_built_from_a_config_the_key(cls, arguments, refusal):
    """A bad setting is refused at construction: plain torch names its own argument (no Hydra key); built from a
    config node at `sampler` (ddpm.config.build), the same refusal names the key the user sets, sampler.*, for
    every argument it names."""
    with pytest.raises(ValueError, match="^" + re.escape(refusal.format(key=""))):
        cls(**arguments)
    cfg = OmegaConf.create({"sampler": {"_target_": f"{cls.__module__}.{cls.__qualname__}", **arguments}})
    with pytest.raises(ValueError, match="^" + re.escape(refusal.format(key="sampler."))):
        build(cfg.sampler)


def test_restart_interval_must_climb_above_t_min():
    """A t_max that rounds to the restart's starting sigma (no interval to restart in) is refused, naming t_max."""
    betas = make_betas("linear", T)
    d = denoiser(toy_net("eps", betas), betas)
    refusal = r"^t_max=0\.0925 rounds to a sigma not above the restart start 0\.09227 .*; raise t_max$"
    with pytest.raises(ValueError, match=refusal):
        RestartSampler(steps=9, t_min=0.06, t_max=0.0925).sample(d, start(), d.sigmas, None)


@pytest.mark.parametrize(
    ("name", "cls", "nfe"),
    [("dpm_solver_sde", DPMSolverSDESampler, 20), ("edm", EDMSampler, 25), ("restart", RestartSampler, 25)],
)
def test_sampler_config_instantiates_within_25_nfe(name, cls, nfe, tmp_path):
    """`sample.py sampler=NAME` composes and builds the sampler with at most 25 network evaluations; every key
    of its YAML has a comment."""
    cfg = compose("sample", [f"sampler={name}", f"output_dir={tmp_path}"])
    sampler = instantiate(cfg.sampler)
    assert isinstance(sampler, cls) and sampler.network_evaluations() == nfe
    lines = (CONF / "sampler" / f"{name}.yaml").read_text().splitlines()
    keys = [line for line in lines if line and not line.startswith(("#", "_target_"))]
    assert keys and all("#" in line for line in keys)


# --- schedule-aware spacings (logsnr, karras) for the DPM-Solvers ---------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [5, 10, 20, 25])
def test_logsnr_and_karras_grids_are_their_closed_forms_rounded(schedule, steps):
    """logsnr: lambda of the chosen t is the nearest available to a grid uniform in lambda (Lu et al. 2022);
    karras: sigma^(1/7) uniform (Karras et al. 2022, eq. 5); both from min(sigma_{T-1}, 80) to sigma_0, with t = T - 1
    first and t = 0 last."""
    alpha_bar = torch.from_numpy(alpha_bar64(make_betas(schedule, T)))
    lam = 0.5 * (alpha_bar.log() - (1 - alpha_bar).log())
    top = max(float(lam[-1]), -math.log(80.0))
    for spacing, target in (
        ("logsnr", np.linspace(top, float(lam[0]), steps)),
        ("karras", -np.log(np.linspace(math.exp(-top) ** (1 / 7), math.exp(-float(lam[0])) ** (1 / 7), steps) ** 7)),
    ):
        grid = DPMSolverSDESampler(steps=steps, spacing=spacing).timesteps(T, alpha_bar).tolist()
        assert grid[0] == T - 1 and grid[-1] == 0 and all(a > b for a, b in itertools.pairwise(grid))
        for t, wanted in zip(grid[1:], target[1:], strict=True):  # the nearest timestep to each grid point
            assert abs(float(lam[t]) - wanted) <= float((lam - wanted).abs().min()) + 1e-12, (spacing, t, wanted)


def test_schedule_spacings_need_the_schedule_and_are_refused_for_ddim():
    """logsnr and karras follow alpha_bar, which timesteps(T) alone does not have; DDIM refuses them (in its own
    words, and naming the key when built from a config)."""
    with pytest.raises(ValueError, match=r"^spacing=logsnr follows the schedule: pass the model's alpha_bar"):
        DPMSolverSampler(steps=10, spacing="logsnr").timesteps(T)
    refusal = "spacing=karras is for sampler=dpm_solver / dpm_solver_sde; use trailing here"
    with pytest.raises(ValueError, match="^" + re.escape(refusal)):
        DDIMSampler(steps=10, spacing="karras")
    cfg = OmegaConf.create({"sampler": {"_target_": "ddpm.diffusion.samplers.ddim.DDIMSampler", "spacing": "karras"}})
    with pytest.raises(ValueError, match="^" + re.escape(f"sampler.{refusal}")):
        build(cfg.sampler)


@pytest.mark.parametrize("cls", [DPMSolverSampler, DPMSolverSDESampler])
def test_logsnr_spacing_removes_the_trailing_grids_blur_on_the_gaussian_data(cls):
    """At 25 network calls the trailing grid's last call is at t = 39 (sigma 0.15 here): E[x0 | x_39] keeps only ~80%
    of the data's std S. The logsnr grid ends at t = 0 and lands within 3% of S (closed form: an exact sampler
    returns std S)."""
    betas = make_betas("linear", T)
    stds = {}
    for spacing in ("trailing", "logsnr"):
        generator = torch.Generator().manual_seed(5)
        x_T = torch.randn((4096, 1, 4, 4), generator=generator)
        d = denoiser(gaussian_net(betas, []), betas)
        out = cls(steps=25, spacing=spacing, clip_denoised=False).sample(d, x_T, d.sigmas, None, generator=generator)
        stds[spacing] = out.double().std().item() / S
    assert abs(stds["logsnr"] - 1) < 0.03 and stds["trailing"] < 0.85, stds
