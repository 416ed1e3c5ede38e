"""Shared fixtures: the real MNIST test files, a writer of tiny CIFAR-10 folders in the real format, the composed
config of a run directory (compose_cfg) and the DDPM CIFAR-10 UNet built once per module (ddpm_cifar10)."""

import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CONF, compose
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

os.environ["DDPM_STRICT_CONFIG"] = "1"  # in-process train()/sample() too: an unchecked config key is an error

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers share the 2 cores: one torch thread each
    torch.set_num_threads(1)

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared/data/mnist"  # /work/shared/data/mnist


@pytest.fixture(scope="session")
def mnist_root() -> Path:
    """The folder holding the real MNIST test set (t10k-*-ubyte.gz); skips when it is absent."""
    names = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    if not all((MNIST_DIR / name).is_file() for name in names):
        pytest.skip(f"the real MNIST test files {names} are not in {MNIST_DIR}")
    return MNIST_DIR


CifarWriter = Callable[..., Path]


@pytest.fixture
def write_cifar(tmp_path: Path) -> CifarWriter:
    """write_cifar({"test_batch": (data (N, 3072) uint8, labels)}) -> a root holding cifar-10-batches-py/.

    Batches are pickled as the CIFAR-10 python release stores them: a dict with 'data' rows of
    1024 red, then 1024 green, then 1024 blue bytes (row-major 32x32 planes) and 'labels'.
    """

    def write(batches: dict[str, tuple[np.ndarray, list[int]]], root: Path | None = None) -> Path:
        root = root or tmp_path / "cifar"
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True, exist_ok=True)
        for name, (data, labels) in batches.items():
            entry = {"batch_label": name, "data": np.asarray(data, dtype=np.uint8), "labels": list(labels)}
            (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        return root

    return write


Compose = Callable[..., DictConfig]


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Compose]:
    """compose_cfg(config_name, overrides): helpers.compose with the Hydra node, the run directory at tmp_path and
    HydraConfig set, so `${hydra:runtime.output_dir}` resolves as under `python train.py`."""

    def run(name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
        cfg = compose(name, [*overrides, f"hydra.runtime.output_dir={tmp_path}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield run
    HydraConfig.instance().cfg = None


@pytest.fixture(scope="module")
def ddpm_cifar10() -> torch.nn.Module:
    """conf/model/ddpm_cifar10.yaml's UNet (35.7M parameters), built once per test module; do not train it."""
    torch.manual_seed(0)
    return instantiate(OmegaConf.load(CONF / "model" / "ddpm_cifar10.yaml"))


# The files that take longest (minutes of subprocesses) run first: with `--dist loadfile` each file stays on one
# worker, and a long file started last would leave the other worker idle at the end. xdist's own order (by test
# count) would override it: the Makefile passes --no-loadscope-reorder. Seconds per file in `make test` (junit,
# 2-core EPYC, 2026-11-28): 192, 141, 130, 117, 99, 91, 78, 73, 64, 63, 58, 51, 51, 44, 42, 42, 37, 33, 32, 31, 30.
LONGEST_FIRST = ["test_docs_commands.py", "test_experiments.py", "test_resume.py", "test_run_faults.py",
                 "test_paths.py", "test_diffusers_native.py", "test_latent_pipeline.py", "test_multinode.py",
                 "test_user_faults.py", "test_workflow.py", "test_data_faults.py", "test_gpu_readiness.py",
                 "test_ddp.py", "test_vae_training.py", "test_export.py", "test_entrypoints.py", "test_faults.py",
                 "test_evaluation.py", "test_webdataset.py", "test_warm.py", "test_edm.py"]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files LONGEST_FIRST, then as collected (the tests inside a file keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
