"""The cases of tests/test_sample_identity.py: every sampler of conf/sampler (its preset, shortened) and variants,
on each diffusion family, with and without guidance. Shared by the test and the script that drew the references."""

from typing import Any

from helpers import CONF
from omegaconf import OmegaConf

FAMILIES: dict[str, dict[str, Any]] = {  # the diffusion config of each family (conf/diffusion), T = 100 for speed
    "linear_eps": {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": 100},
    "cosine_v": {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": 100, "schedule": "cosine",
                 "prediction": "v"},
    "edm": {"_target_": "ddpm.diffusion.edm.EDMDiffusion", "num_timesteps": 100},
}  # fmt: skip

# name -> (conf/sampler/<file>, changes to it, guidance w, guidance interval, precision)
CASES: dict[str, tuple[str, dict[str, Any], float, tuple[float, float] | None, str]] = {
    "ddpm_all": ("ddpm", {"steps": None}, 0.0, None, "32"),
    "ddpm_10": ("ddpm", {"steps": 10}, 0.0, None, "32"),
    "ddpm_10_large": ("ddpm", {"steps": 10, "variance": "fixed_large"}, 0.0, None, "32"),
    "ddpm_10_guided": ("ddpm", {"steps": 10}, 2.0, None, "32"),
    "ddim_8": ("ddim", {"steps": 8}, 0.0, None, "32"),
    "ddim_8_eta1": ("ddim", {"steps": 8, "eta": 1.0}, 0.0, None, "32"),
    "ddim_8_leading": ("ddim", {"steps": 8, "spacing": "leading", "steps_offset": 1}, 0.0, None, "32"),
    "ddim_8_guided_interval": ("ddim", {"steps": 8}, 1.5, (0.3, 5.0), "32"),
    "dpm_8": ("dpm_solver", {"steps": 8}, 0.0, None, "32"),
    "dpm_8_order1": ("dpm_solver", {"steps": 8, "order": 1}, 0.0, None, "32"),
    "dpm_8_logsnr": ("dpm_solver", {"steps": 8, "spacing": "logsnr"}, 0.0, None, "32"),
    "dpm_8_karras_guided": ("dpm_solver", {"steps": 8, "spacing": "karras"}, 1.0, None, "32"),
    "sde_8": ("dpm_solver_sde", {"steps": 8}, 0.0, None, "32"),
    "sde_8_guided": ("dpm_solver_sde", {"steps": 8}, 0.5, None, "32"),
    "sde_8_bf16": ("dpm_solver_sde", {"steps": 8}, 0.0, None, "bf16"),
    "edm_5": ("edm", {"steps": 5}, 0.0, None, "32"),
    "edm_5_heun": ("edm", {"steps": 5, "churn": 0.0}, 0.0, None, "32"),
    "edm_5_guided_interval": ("edm", {"steps": 5}, 2.0, (0.2, 10.0), "32"),
    "restart_4": ("restart", {"steps": 4, "restart_steps": 1, "restarts": 1}, 0.0, None, "32"),
    "restart_4_guided": ("restart", {"steps": 4, "restart_steps": 1, "restarts": 1}, 1.0, None, "32"),
}


def sampler_config(name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """conf/sampler/<name>.yaml with `changes` applied, as a plain dict."""
    return {**OmegaConf.to_container(OmegaConf.load(CONF / "sampler" / f"{name}.yaml")), **changes}
