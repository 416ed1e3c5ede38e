"""What every test shares: one subprocess runner, one compose helper, one tiny UNet.

- `run(*argv, ...)` runs a command from the repository root as a user would (`python train.py ...`,
  `python -m ddpm.export ...`), with one environment for every test: one OpenMP thread (tests run
  beside each other on 2 cores), W&B offline with its folders under a temp dir, full Hydra errors.
- `compose(name, overrides)` composes `conf/<name>.yaml` exactly as `train.py` / `sample.py` would.
- `tiny_unet(**changes)` and `TINY_UNET` are the one small network the unit tests build; `perturbed_unet()` its
  conditional form with non-zero outputs; `tiny_unet_config()` its `model:` config, for an ema.pt.
- `TINY_RUN` are the overrides of a seconds-long `train.py` run on the default (digits) experiment.
"""

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import warm
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PYTHON = sys.executable
_WANDB_HOME = Path(tempfile.gettempdir()) / "ddpm-tests-wandb"

ENV = {
    "OMP_NUM_THREADS": "1",  # 2 cores shared by the suite; also keeps forked writers out of OpenMP
    "HYDRA_FULL_ERROR": "1",
    "DDPM_STRICT_CONFIG": "1",  # a config the validator cannot fully check is an error in tests, not a warning
    "WANDB_MODE": "offline",  # no default command may reach W&B's login prompt
    "WANDB_SILENT": "true",
    **{f"WANDB_{k}": str(_WANDB_HOME / k.lower()) for k in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR")},
    "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}

TINY_UNET: dict[str, Any] = dict(
    in_channels=1,
    image_size=8,
    base_channels=16,
    channel_mult=(1, 2),
    num_res_blocks=1,
    attention_resolutions=(4,),
    num_heads=2,
    dropout=0.0,
    norm_groups=4,
)

TINY_RUN = [
    "data.limit=256",
    "data.batch_size=32",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_train_steps=3",
    "callbacks.sample_grid.every_n_steps=6",
    "callbacks.sample_grid.num_samples=4",
    "callbacks.sample_grid.sampler.steps=4",
]


def tiny_unet(**changes: Any):
    """The tests' small UNet (1x8x8, 2 levels, attention at 4x4), with `changes` applied."""
    from ddpm.models.unet import UNet

    return UNet(**(TINY_UNET | changes))


def tiny_unet_config(num_classes: int | None = None) -> dict[str, Any]:
    """`model:` of a run config for tiny_unet(num_classes=...), as train.py writes it into ema.pt (lists, not
    tuples: a resolved YAML config)."""
    model = {"_target_": "ddpm.models.unet.UNet", **TINY_UNET, "num_classes": num_classes}
    return model | {key: list(model[key]) for key in ("channel_mult", "attention_resolutions")}


def perturbed_unet():
    """The tests' tiny conditional UNet with every weight moved by 0.05 N(0, 1) (its zero-initialised output
    layer would otherwise give identical images at any precision, with or without guidance)."""
    import torch

    torch.manual_seed(0)
    net = tiny_unet(num_classes=10).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def env(**extra: str) -> dict[str, str]:
    """The subprocess environment of every test, with `extra` set on top."""
    return {**os.environ, **ENV, **extra}


def run(
    *argv: str | Path,
    cwd: Path = REPO,
    check: bool = True,
    timeout: float = 300,
    extra_env: dict[str, str] | None = None,
    shell: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` (`"python"` becomes this interpreter) from `cwd`; on failure raise with the output's tail.

    With shell=True, argv is one command line run by bash, as a user would type it."""
    full, words = env(**(extra_env or {})), [str(a) for a in argv]
    command: str | list[str] = [PYTHON if a == "python" else a for a in words]
    if shell:
        (command,) = words  # one command line
    if not shell and warm.eligible(words, _changed(full)):  # a fork of the warm server: imports already done
        result = _warm_run(words, cwd, full, timeout)
    else:
        result = subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout,
                                shell=shell, executable="/bin/bash" if shell else None)  # fmt: skip
    if check and result.returncode != 0:
        shown = command if shell else " ".join(command[:4])
        raise AssertionError(f"{shown} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}")
    return result


_POOL: list[warm.Pool] = []  # this pytest process's warm servers (tests/warm.py), made on first use


def _changed(full: dict[str, str]) -> dict[str, str]:
    """The keys in which `full` differs from the warm servers' environment (the tests' own, env())."""
    base = _POOL[0].env if _POOL else env()
    return {k: full.get(k, "") for k in base.keys() | full.keys() if full.get(k) != base.get(k)}


def _warm_run(argv: list[str], cwd: Path, full: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`argv` as a fork of a warm server of this process."""
    _POOL[:] = _POOL or [warm.Pool(env())]
    return _POOL[0].run(argv, cwd=cwd, env=full, timeout=timeout)


def train(
    *overrides: str, check: bool = True, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python train.py *overrides` (give hydra.run.dir=... to keep the run out of outputs/)."""
    return run("python", "train.py", *overrides, check=check, timeout=timeout, extra_env=extra_env)


def sample(
    *overrides: str, check: bool = True, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python sample.py *overrides` (give output_dir=...)."""
    return run("python", "sample.py", *overrides, check=check, timeout=timeout, extra_env=extra_env)


def wandb_dirs(folder: Path) -> dict[str, str]:
    """W&B's folders under `folder` (extra_env of a test that reads what W&B wrote)."""
    return {f"WANDB_{k}": str(folder / f"wandb_{k.lower()}") for k in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR")}


def compose(name: str = "train", overrides: Sequence[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    """conf/<name>.yaml composed with `overrides`, as the entry point would (give paths.output_dir=...)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(name, overrides=list(overrides), return_hydra_config=return_hydra_config)


# CPU kinds for `auto` precision and compile: (native bf16, AMX, does `auto` take bf16) for an AVX2-only CPU, an
# AVX512-BF16 CPU without AMX and an AMX CPU (ddpm.precision.fast_bf16)
CPU_KINDS = [(False, False, False), (True, False, False), (True, True, True)]


def use_cpu(monkeypatch: Any, *, native: bool, amx: bool) -> None:
    """Make ddpm.precision see a CPU of this kind, and no GPU."""
    import torch

    from ddpm import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: native and device == "cpu")
    monkeypatch.setattr(precision, "cpu_amx", lambda: amx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def denoiser(
    net: Any,
    betas: Any,
    *,
    prediction: str = "eps",
    guidance: float = 0.0,
    null_class: int | None = None,
    guidance_interval: tuple[float, float] | None = None,
    sigma_data: float | None = None,
) -> Any:
    """What the sampler tests drive: `net` on the DDPM schedule `betas` as a denoiser (an EDM network, with
    sigma_data, on the levels sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) of those betas), guided when guidance
    != 0, counting its network calls (`.calls`). Call a sampler with `sampler.sample(d, x_T, d.sigmas, y)`."""
    from ddpm.diffusion.denoiser import Guided
    from ddpm.diffusion.edm import EDMDenoiser
    from ddpm.diffusion.gaussian import VPDenoiser
    from ddpm.diffusion.generate import Counted
    from ddpm.diffusion.schedule import alpha_bar_from_betas

    alpha_bar = alpha_bar_from_betas(betas.double())
    if sigma_data is not None:
        made = EDMDenoiser(net=net, sigmas=((1 - alpha_bar) / alpha_bar).sqrt(), sigma_data=sigma_data)
    else:
        made = VPDenoiser(net=net, alpha_bar=alpha_bar, prediction=prediction)
    if guidance != 0:
        made = Guided(made, guidance=guidance, null_class=null_class, interval=guidance_interval)
    return Counted(made)
