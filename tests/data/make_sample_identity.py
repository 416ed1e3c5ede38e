"""Reference images for tests/test_sample_identity.py, drawn with the sampling API of commit 2febb02+ (before the
denoiser refactor): every sampler preset of conf/sampler and variants, on every diffusion family, with and without
guidance (and a guidance interval), on the tests' tiny conditional UNet with perturbed weights."""

import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import numpy as np
import torch
from helpers import perturbed_unet
from hydra.utils import instantiate
from identity_cases import CASES, FAMILIES, sampler_config

from ddpm.diffusion.generate import generate

out = {}
for family, diffusion_cfg in FAMILIES.items():
    diffusion = instantiate(diffusion_cfg)
    for name, (sampler_name, changes, guidance, interval, precision) in CASES.items():
        net = perturbed_unet()
        sampler = instantiate(sampler_config(sampler_name, changes))
        g = generate(
            net=net,
            betas=diffusion.betas64(),
            prediction=diffusion.prediction,
            sigma_data=diffusion.sigma_data,
            sampler=sampler,
            image_shape=(1, 8, 8),
            num_samples=6,
            labels=torch.arange(6) % 10,
            null_class=10,
            guidance=guidance,
            guidance_interval=interval,
            seed=3,
            batch_size=4,
            precision=precision,
        )
        out[f"{family}/{name}"] = g.images.numpy()
        print(family, name, g.nfe, g.images.float().mean().item())
np.savez_compressed(str(__import__("pathlib").Path(__file__).with_name("sample_identity.npz")), **out)
