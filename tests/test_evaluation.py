"""Evaluation end to end: the FID callback in a tiny train.py run, sample.py metrics=[...], torchrun sharding.

The feature extractor is a stand-in: an untrained SmallClassifier saved as TorchScript, exactly the
file kind `benchmarks/mnist_quality.py --save-classifier` writes, so no Inception weights are needed.
"""

import json
import math
import shutil
import socket
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import TINY_RUN, compose, run, sample, train
from hydra.utils import instantiate

from ddpm.callbacks.fid import FID
from ddpm.metrics.classifier import SmallClassifier, save_torchscript
from ddpm.sampling.run import requested_metrics

# The tiny run, stopped at its first validation (step 3), conditional, without the sample grid.
EVAL_RUN = [*TINY_RUN, "trainer.max_steps=3", "callbacks.sample_grid=null", "model.num_classes=10"]


def test_sample_config_selects_metrics_and_train_config_adds_the_fid_callback_only_when_asked() -> None:
    """metrics=[fid,kid,is] switches metrics on (none by default); +callbacks/fid=... adds FID (absent by default)."""
    assert requested_metrics(compose("sample", []).metrics) == []
    cfg = compose("sample", ["metrics=[is,fid,kid]", "metrics.features=clf.pt"])
    assert requested_metrics(cfg.metrics) == ["fid", "kid", "is"] and cfg.metrics.features == "clf.pt"
    assert "fid" not in compose("train", []).callbacks
    for option in ("inception", "classifier"):
        cfg = compose("train", [f"+callbacks/fid={option}", "callbacks.fid.features=x.pt"])
        callback = instantiate(cfg.callbacks.fid)
        assert isinstance(callback, FID) and callback.sampler.steps == 50 and callback.metrics == ("fid",)
    with pytest.raises(ValueError, match="choose from"):
        FID(sampler=callback.sampler, metrics=("fld",))


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-step conditional digits run with `+callbacks/fid=classifier` evaluating at step 3."""
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    classifier = save_torchscript(SmallClassifier(in_channels=1, num_classes=10), root / "clf.pt", image_size=32)
    train(*EVAL_RUN, "+callbacks/fid=classifier", f"callbacks.fid.features={classifier}",
          "callbacks.fid.every_n_steps=3", "callbacks.fid.num_samples=8", "callbacks.fid.batch_size=4",
          "callbacks.fid.sampler.steps=2", "callbacks.fid.metrics=[fid,kid]",
          f"callbacks.fid.cache_dir={root / 'cache'}", "objective=val/cfid@8",
          f"hydra.run.dir={root / 'run'}")  # fmt: skip
    return {"run": root / "run", "classifier": classifier, "cache": root / "cache"}


@pytest.mark.slow
def test_fid_callback_logs_the_classifier_fid_of_k_samples(evaluated_run: dict[str, Path]) -> None:
    """val/cfid@8 and val/ckid@8 are logged (finite, >= 0); the training set's statistics were cached."""
    header, *rows = (evaluated_run["run"] / "csv" / "metrics.csv").read_text().splitlines()
    columns = header.split(",")
    assert {"val/cfid@8", "val/ckid@8", "val/accuracy@8"} <= set(columns), columns
    values = [
        float(r.split(",")[columns.index("val/cfid@8")]) for r in rows if r.split(",")[columns.index("val/cfid@8")]
    ]
    assert len(values) == 1 and math.isfinite(values[0]) and values[0] >= 0
    result = json.loads((evaluated_run["run"] / "result.json").read_text())  # what a sweep optimises
    assert result["val/cfid@8"] == pytest.approx(values[0], rel=1e-6)
    cached = list(evaluated_run["cache"].iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("digits-all-16px-clf-")


@pytest.mark.slow
def test_sample_py_metrics_on_one_process_and_under_torchrun_agree(
    evaluated_run: dict[str, Path], tmp_path: Path
) -> None:
    """sample.py metrics=[fid,kid,is] writes metrics.json named by sample count, reusing the cached statistics;
    two gloo ranks under torchrun draw disjoint shares whose gathered images equal the one-process run's."""
    common = [f"ckpt={evaluated_run['run'] / 'ema.pt'}", "num_samples=10", "batch_size=4", "sampler.steps=2", "seed=3"]
    metrics = ["metrics=[fid,kid,is]", f"metrics.features={evaluated_run['classifier']}",
               f"metrics.cache_dir={evaluated_run['cache']}"]  # fmt: skip
    one = sample(*common, *metrics, f"hydra.run.dir={tmp_path / 'one'}")
    assert "reference statistics" not in one.stdout  # computed by the training run, read from the cache
    result = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert {"cfid@10", "ckid@10", "cis@10", "accuracy@10"} <= set(result), result
    assert all(math.isfinite(result[k]) for k in ("cfid@10", "ckid@10", "cis@10"))
    assert 0 <= result["accuracy@10"] <= 1

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run("python", "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
        "sample.py", *common, "device=cpu", f"hydra.run.dir={tmp_path / 'two'}")  # fmt: skip
    single, sharded = np.load(tmp_path / "one" / "samples.npz"), np.load(tmp_path / "two" / "samples.npz")
    np.testing.assert_array_equal(single["labels"], sharded["labels"])
    np.testing.assert_array_equal(single["images"], sharded["images"])


def test_sample_py_refuses_its_metric_settings_before_drawing_an_image(evaluated_run: dict[str, Path],
                                                                        tmp_path: Path) -> None:  # fmt: skip
    """A mistyped metrics.features (or Inception's weights missing offline, `is` without logits, one image) was found
    after every image was drawn: N images' sampling lost to a typo."""
    common = [f"ckpt={evaluated_run['run'] / 'ema.pt'}", "batch_size=4", "sampler.steps=2", "metrics=[fid]"]
    typo = sample(*common, "num_samples=4", f"metrics.features={tmp_path / 'classifer.pt'}",
                  f"hydra.run.dir={tmp_path / 'typo'}", check=False)  # fmt: skip
    one = sample(*common, "num_samples=1", f"metrics.features={evaluated_run['classifier']}",
                 f"hydra.run.dir={tmp_path / 'one'}", check=False)  # fmt: skip
    assert typo.returncode != 0 and "classifer.pt" in typo.stderr, typo.stderr[-2000:]
    assert one.returncode != 0 and "num_samples=1: the metrics need at least 2 images" in one.stderr
    assert not list(tmp_path.rglob("samples.npz")) and " images in " not in typo.stdout + one.stdout


def test_the_fid_callback_refuses_an_is_it_cannot_compute_before_the_first_step(tmp_path: Path) -> None:
    """`is` on fewer than 10 images, or with a classifier without logits, trained to the first evaluation (1,000 or
    5,000 steps by the presets) and failed there, before that step's checkpoint: refused when the callback is built
    and at fit start, before the reference statistics."""
    from types import SimpleNamespace

    from ddpm.data.sources import DigitsSource
    from ddpm.diffusion.samplers.ddim import DDIMSampler

    with pytest.raises(ValueError, match=r"callbacks.fid.num_samples=5: metrics \['fid', 'is'\] need at least 10"):
        FID(sampler=DDIMSampler(steps=2), metrics=("fid", "is"), num_samples=5)
    features = tmp_path / "features_only.pt"  # the TorchScript contract's logits(x) is optional
    torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))).save(str(features))
    callback = FID(sampler=DDIMSampler(steps=2), metrics=("fid", "is"), num_samples=10, features=str(features),
                   cache_dir=str(tmp_path / "cache"))  # fmt: skip
    trainer = SimpleNamespace(datamodule=SimpleNamespace(source=DigitsSource(), image_size=8, channels=1))
    with pytest.raises(ValueError, match=rf"callbacks.fid.metrics: is needs class logits; .*features={features} has"):
        callback.on_fit_start(trainer, SimpleNamespace(device=torch.device("cpu")))
    assert not (tmp_path / "cache").exists()  # refused before the reference statistics


def test_sample_py_refuses_a_moved_training_set_before_drawing_naming_metrics_data_root(
    evaluated_run: dict[str, Path], tmp_path: Path, write_cifar
) -> None:
    """The run's data folder gone (moved since training) was found by the reference statistics, after every image
    was drawn, advising `data.root=`, a key sample.py does not have; now before the first image, naming
    metrics.data_root. Statistics cached for that data still stand without it, as reference_stats lets them."""
    import numpy as np

    from ddpm.data.sources import CIFAR10Source
    from ddpm.metrics.features import build_extractor
    from ddpm.metrics.fid import reference_stats
    from ddpm.sampling.run import metrics_extractor

    moved = tmp_path / "cifar_moved"
    source = {"_target_": "ddpm.data.sources.CIFAR10Source", "root": str(moved), "split": "test"}
    cache = tmp_path / "cache"
    cfg = compose("sample", ["metrics=[fid]", f"metrics.features={evaluated_run['classifier']}",
                             f"metrics.cache_dir={cache}"])  # fmt: skip
    check = lambda: metrics_extractor(cfg, {"data": {"source": source}}, 8, torch.device("cpu"), (3, 32, 32))  # noqa: E731
    with pytest.raises(FileNotFoundError, match=rf"metrics: .*{moved}.*pass its folder as metrics.data_root=") as error:
        check()
    assert "data.root=" not in str(error.value).replace("metrics.data_root=", "")  # a key sample.py does not have
    batches = {"test_batch": (np.random.default_rng(0).integers(0, 256, (12, 3072), dtype=np.uint8), [0] * 12)}
    cfg.metrics.data_root = str(write_cifar(batches, tmp_path / "cifar_now"))
    check()  # where it is now
    write_cifar(batches, moved)
    reference_stats(CIFAR10Source(root=str(moved), split="test"), image_size=32, channels=3, cache_dir=cache,
                    extractor=build_extractor(str(evaluated_run["classifier"])))  # fmt: skip  # cached, then moved
    shutil.rmtree(moved)
    cfg.metrics.data_root = None
    check()


class StubFID(FID):
    """The callback's schedule and logging, its evaluation stubbed: the value is the step it ran at."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pass

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        return {"fid@1k": float(trainer.global_step)}


class Line(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_fid_values_reach_the_loggers_at_the_step_they_were_measured(tmp_path: Path) -> None:
    """FID every 2 steps, Lightning writing every 4: self.log's value waited for Lightning's next logging step and
    was written under it, and the last one (step 6 of 7) never reached metrics.csv, though the objective read it."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    fid = StubFID(sampler=None, every_n_steps=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=7, log_every_n_steps=4, callbacks=[fid], logger=CSVLogger(
        tmp_path, name="csv", version=0), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Line(), DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4))
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]) for r in rows if r["train/loss"]}  # Lightning's own rows: global step g at g - 1
    fids = [(int(r["step"]), float(r["val/fid@1k"])) for r in rows if r["val/fid@1k"]]
    assert fids == [(1, 2.0), (3, 4.0), (5, 6.0)] and losses == {3}  # step 4's at a logged step, the others not
    assert float(trainer.callback_metrics["val/fid@1k"]) == 6.0  # mixing self.log in: step 4's stale value
