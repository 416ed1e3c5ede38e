"""Exact resume: a run SIGKILLed mid-training and resumed equals, bit for bit, a run that was never stopped.

Every run is `python train.py` as a subprocess on the same tiny, deterministic CPU config, with
everything that draws random numbers switched on: timesteps and noise, dropout (model.dropout),
label dropout (a conditional model with p_uncond), random flips (data.hflip) and validation every
3 batches. The data has 4 training batches per epoch; checkpoints are written every step.
"""

import csv
import signal
import subprocess
import time
from pathlib import Path

import helpers
import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch.utils.data import DistributedSampler

RNG_HEAVY = [
    "data.limit=80",  # 72 training images (0.1 held out): 4 batches of 16 per epoch
    "data.batch_size=16",
    "data.hflip=true",
    "model.dropout=0.1",
    "model.num_classes=10",
    "diffusion.p_uncond=0.2",
    "trainer.deterministic=true",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "optim.warmup_steps=3",
    "callbacks.checkpoint.every_n_train_steps=1",
    "callbacks.checkpoint.save_top_k=-1",
    "callbacks.checkpoint.monitor=null",
    "callbacks.sample_grid=null",
    "callbacks.progress_bar=null",
]


def train(run_dir: Path, *overrides: str) -> None:
    """`python train.py` on the RNG-heavy config (helpers.train: one OpenMP thread, as the resumes need)."""
    helpers.train(*RNG_HEAVY, *overrides, f"hydra.run.dir={run_dir}")


def train_and_kill(run_dir: Path, kill_after: str, *overrides: str) -> None:
    """Start a long run, SIGKILL it as soon as `checkpoints/<kill_after>` exists (no chance to clean up)."""
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    argv = [helpers.PYTHON, "train.py", *RNG_HEAVY, "trainer.max_steps=1000", *overrides, f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(argv, cwd=helpers.REPO, env=helpers.env(), stdout=log, stderr=subprocess.STDOUT)
    target, deadline = run_dir / "checkpoints" / kill_after, time.monotonic() + 240
    while not target.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, f"the run ended on its own: {log.name}"
    assert target.exists()


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(straight: Path, resumed: Path) -> None:
    """Weights, EMA weights, optimizer state, LR schedule and step counters: torch.equal, key by key."""
    a, b = load(straight), load(resumed)
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"]
    for key in ("state_dict", "ema_state_dict"):
        assert a[key].keys() == b[key].keys()
        unequal = [k for k in a[key] if not torch.equal(a[key][k], b[key][k])]
        assert not unequal, f"{key}: {unequal[:5]} differ"
    (opt_a,), (opt_b,) = a["optimizer_states"], b["optimizer_states"]
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for index, state in opt_a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, opt_b["state"][index][name]), f"optimizer state {index}.{name} differs"
    assert a["lr_schedulers"] == b["lr_schedulers"]


def train_losses(run_dir: Path) -> dict[int, list[str]]:
    """step -> the train/loss values logged at it, as the CSV holds them (text: no rounding in the compare)."""
    losses: dict[int, list[str]] = {}
    with (run_dir / "csv" / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                losses.setdefault(int(row["step"]), []).append(row["train/loss"])
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Straight 8 steps; a run killed after step 6; resumes from its step 4 (epoch end) and step 6 (mid-epoch)."""
    root = tmp_path_factory.mktemp("resume")
    train(root / "straight", "trainer.max_steps=8")
    train_and_kill(root / "killed", "step_0000006.ckpt")
    for step in (4, 6):
        train(
            root / f"resumed_{step}", "trainer.max_steps=8", f"ckpt_path={root}/killed/checkpoints/step_{step:07d}.ckpt"
        )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("step", [4, 6], ids=["epoch-boundary", "mid-epoch"])
def test_killed_and_resumed_equals_straight(runs: Path, step: int) -> None:
    assert_same_state(runs / "straight/checkpoints/last.ckpt", runs / f"resumed_{step}/checkpoints/last.ckpt")
    straight, resumed = train_losses(runs / "straight"), train_losses(runs / f"resumed_{step}")
    after = {s: v for s, v in straight.items() if s >= step}
    assert after and resumed == after, "the train losses logged after the resume differ"


@pytest.mark.slow
def test_resume_records_the_safe_config_changes(runs: Path) -> None:
    """max_steps differed between the killed run (1000) and the resume (8): allowed, printed, saved."""
    record = yaml.safe_load((runs / "resumed_6" / "resume_diff.yaml").read_text())
    assert record["resumed_from"].endswith("step_0000006.ckpt") and record["global_step"] == 6
    assert record["changed"]["trainer.max_steps"] == {"checkpoint": 1000, "now": 8}
    run_dir_keys = {"callbacks.checkpoint.dirpath", "logger.csv.save_dir", "logger.tensorboard.save_dir"}
    assert set(record["changed"]) == {"trainer.max_steps", *run_dir_keys}  # the paths under the new run directory


@pytest.mark.slow
def test_resume_under_gradient_accumulation(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 (2 steps per epoch); killed after step 3, mid-epoch 1; resumed to step 5."""
    accumulate = ["trainer.accumulate_grad_batches=2"]
    train(tmp_path / "straight", *accumulate, "trainer.max_steps=5")
    train_and_kill(tmp_path / "killed", "step_0000003.ckpt", *accumulate)
    checkpoint = tmp_path / "killed/checkpoints/step_0000003.ckpt"
    train(tmp_path / "resumed", *accumulate, "trainer.max_steps=5", f"ckpt_path={checkpoint}")
    assert_same_state(tmp_path / "straight/checkpoints/last.ckpt", tmp_path / "resumed/checkpoints/last.ckpt")
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert resumed == {s: v for s, v in straight.items() if s >= 3}


class Indices(torch.utils.data.Dataset):
    """Sample i is the number i: the batches name the positions trained on."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


class Recording(pl.LightningModule):
    """Records (epoch, batch) as rank 0 of `world` processes (the sampler's share; one process trains it)."""

    def __init__(self, batch_size: int = 2, world: int = 1) -> None:
        super().__init__()
        self.net, self.seen, self.batch_size, self.world = torch.nn.Linear(1, 1), [], batch_size, world

    def on_train_start(self) -> None:
        from ddpm.module import DiffusionModule

        DiffusionModule._follow_data_position(self)  # the product's: Lightning's count follows the loader's

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch.view(-1).long().tolist()))
        return self.net(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        from ddpm.data.sampler import ResumableLoader, ResumableSampler

        data = Indices()
        sampler = ResumableSampler(data, num_replicas=self.world, rank=0, seed=0)
        return ResumableLoader(data, sampler=sampler, batch_size=self.batch_size, drop_last=True)


@pytest.mark.parametrize("limit", [2, 6])  # of 8 batches per epoch
def test_a_resume_at_the_end_of_an_epoch_cut_by_limit_train_batches_equals_the_straight_run(tmp_path, limit) -> None:
    """The checkpoint after the limit's last batch: the sampler's resume skip (12 of epoch 0's 16 positions at
    limit 6) was applied to epoch 1 instead, which then lost its first batches."""

    def fit(ckpt_path=None) -> list:
        module = Recording()
        every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = pl.Trainer(max_epochs=3, limit_train_batches=limit, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[every], accelerator="cpu")  # fmt: skip
        trainer.fit(module, ckpt_path=ckpt_path)
        return module.seen

    straight = fit()
    assert [epoch for epoch, _ in straight] == [0] * limit + [1] * limit + [2] * limit
    assert fit(tmp_path / f"step={limit}.ckpt") == straight[limit:]


def share(epoch: int, world: int) -> list[int]:
    """Rank 0's positions of `epoch` among `world` processes: DistributedSampler's deal of randperm(16) (seed 0)."""
    sampler = DistributedSampler(Indices(), num_replicas=world, rank=0, seed=0, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def batches(positions: list[int], size: int) -> list[list[int]]:
    return [positions[i : i + size] for i in range(0, len(positions) - size + 1, size)]


@pytest.mark.parametrize(
    ("before", "after", "step"),
    [((2, 2), (1, 2), 4), ((1, 2), (2, 2), 3), ((1, 2), (1, 3), 7), ((2, 2), (2, 5), 2), ((2, 3), (1, 2), 2),
     ((2, 5), (2, 2), 1), ((1, 4), (1, 2), 4)],
    ids=["epoch-end-world-2-to-1", "mid-world-1-to-2", "mid-none-left", "mid-world-none-left",
         "epoch-end-batches-left", "epoch-end-world-batches-left", "epoch-end-batch-4-to-2"],
)  # fmt: skip
def test_a_resume_at_another_world_or_batch_size_trains_the_epochs_rest_then_whole_epochs(
    tmp_path, before, after, step
) -> None:
    """(world, batch) before and after, the checkpoint after `step` (this rank trains 16 // world positions of
    each epoch). The resumed run trains what is left of epoch 0 at the new sizes (none of it again), then epochs 1
    and 2 whole. Where no whole batch is left, epoch 0 ended (before: it was trained again from its start); at an
    epoch's last step Lightning may end it whatever is left (before: epoch 1 then lost batches)."""
    (world, batch), (new_world, new_batch) = before, after
    every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    options = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
               "default_root_dir": tmp_path}  # fmt: skip
    pl.Trainer(max_epochs=1, callbacks=[every], **options).fit(Recording(batch, world))
    resumed = Recording(new_batch, new_world)
    pl.Trainer(max_epochs=3, **options).fit(resumed, ckpt_path=tmp_path / f"step={step}.ckpt")
    rest = batches(share(0, new_world)[-(-step * batch * world // new_world) :], new_batch)
    epoch_end = step == len(share(0, world)) // batch
    assert [b for e, b in resumed.seen if e == 0] in ([rest, []] if epoch_end else [rest])
    assert [b for e, b in resumed.seen if e > 0] == batches(share(1, new_world), new_batch) + batches(
        share(2, new_world), new_batch
    )


@pytest.mark.slow
def test_a_checkpoint_due_on_an_epochs_last_batch_is_written_at_its_step(tmp_path: Path) -> None:
    """3 batches per epoch, a checkpoint every 3 steps, validation every 100: Lightning held a save that falls on
    an epoch's last batch until the next validation (here never: only last.ckpt at the end), so a run killed in
    between lost it. conf/callbacks/default.yaml saves it at its step."""
    sizes = ["data.limit=64", "data.batch_size=16", "trainer.max_steps=7", "callbacks.checkpoint.every_n_train_steps=3"]
    helpers.train(*sizes, "callbacks.sample_grid=null", "trainer.val_check_interval=100", f"hydra.run.dir={tmp_path}")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last.ckpt", "step_0000003.ckpt", "step_0000006.ckpt"]  # fmt: skip


@pytest.mark.slow
def test_under_gradient_accumulation_no_grid_is_drawn_before_the_first_step(tmp_path: Path) -> None:
    """The first micro-batches end at global_step 0, a multiple of every_n_steps: a grid of the untrained EMA was
    drawn (samples/step_0000000.png); the step a fit starts at (0, or a resume's) now draws none."""
    helpers.train("data.limit=64", "data.batch_size=16", "trainer.accumulate_grad_batches=2", "trainer.max_steps=2",
                  "callbacks.sample_grid.every_n_steps=2", "callbacks.sample_grid.num_samples=4",
                  "callbacks.sample_grid.sampler.steps=2", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_0000002.png"]


@pytest.mark.slow
def test_a_resume_with_a_longer_max_steps_follows_its_own_decay_from_the_first_step(tmp_path: Path) -> None:
    """Cosine decay, a checkpoint at step 5 of an 8-step run, resumed with trainer.max_steps=10: step 5 ran at the
    8-step schedule's LR (the optimizer's, restored) when optim.lr was unchanged; the run's LR rule is logged at the
    step it starts at (before: at step 0 again)."""
    from ddpm.optim import AdamW

    common = ["data.limit=64", "data.batch_size=16", "callbacks.sample_grid=null", "trainer.log_every_n_steps=1",
              "optim.lr=1e-3", "optim.warmup_steps=4", "optim.decay=cosine", "optim.min_lr_ratio=0.1",
              "trainer.val_check_interval=100", "logger=csv"]  # fmt: skip
    helpers.train(*common, "trainer.max_steps=8", "callbacks.checkpoint.every_n_train_steps=5",
                  f"hydra.run.dir={tmp_path / 'a'}")  # fmt: skip
    helpers.train(*common, "trainer.max_steps=10", f"ckpt_path={tmp_path / 'a/checkpoints/step_0000005.ckpt'}",
                  f"hydra.run.dir={tmp_path / 'b'}")  # fmt: skip
    with (tmp_path / "b" / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    lr = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    schedule = AdamW(lr=1e-3, warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    assert lr == pytest.approx({s: 1e-3 * schedule.lr_factor(s, 10) for s in range(5, 10)})
    assert [int(r["step"]) for r in rows if r.get("optim/lr_scaled")] == [5]


@pytest.mark.parametrize(("saved", "world"), [(1, 2), (2, 1)])
def test_a_resume_at_another_world_size_says_the_rng_streams_are_not_the_originals(saved: int, world: int) -> None:
    """Rank 0 restores its own state and says nothing while the other ranks took a warning branch that
    rank_zero_warn silences there: growing 1 -> 2 ranks (and shrinking 2 -> 1) resumed without the warning."""
    from types import SimpleNamespace

    from ddpm.callbacks.rng import RNGState, collect

    callback = RNGState(seed=0)
    callback.load_state_dict({"per_rank": [collect()] * saved})
    with pytest.warns(UserWarning, match=rf"RNG states for {saved} rank\(s\), this run has {world}; .*bit-for-bit"):
        callback.on_train_start(SimpleNamespace(global_rank=0, world_size=world), None)  # type: ignore[arg-type]
    assert callback.snapshot is not None  # rank 0's own state restored all the same


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [["trainer.val_check_interval=100"], ["trainer.val_check_interval=5"],
     ["trainer.val_check_interval=4", "trainer.accumulate_grad_batches=2"]],
    ids=["no-validation-at-the-end", "validation-at-the-end", "accumulated"],
)  # fmt: skip
def test_last_ckpt_holds_the_runs_end_and_a_resume_from_it_continues_as_the_straight_run(
    tmp_path: Path, extra: list[str]
) -> None:
    """max_steps=5 with a checkpoint every 3 steps (4 batches per epoch: the run stops inside epoch 2): Lightning's
    last.ckpt stayed at step 3, behind ema.pt, so `ckpt_path=<it>` with a longer max_steps trained steps 4-5 again.
    Written at the fit's end instead, a resume began epoch 3, skipping the rest of epoch 2, and with a validation at
    the last step logged every metric one step late. Now it continues the straight 8-step run: the same losses, each
    step logged once at its own number; last.ckpt's EMA is ema.pt's."""
    common = [*RNG_HEAVY[:8], "callbacks.sample_grid=null", "callbacks.progress_bar=null", "logger=csv",
              "trainer.log_every_n_steps=1", "optim.warmup_steps=2", "callbacks.checkpoint.every_n_train_steps=3",
              *extra]  # fmt: skip
    helpers.train(*common, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'straight'}")
    helpers.train(*common, "trainer.max_steps=5", f"hydra.run.dir={tmp_path / 'a'}")
    last, ema = load(tmp_path / "a/checkpoints/last.ckpt"), load(tmp_path / "a/ema.pt")
    assert last["global_step"] == 5
    assert all(torch.equal(last["ema_state_dict"][k], v) for k, v in ema["ema_state_dict"].items())
    helpers.train(*common, "trainer.max_steps=8", f"ckpt_path={tmp_path / 'a/checkpoints/last.ckpt'}",
                  f"hydra.run.dir={tmp_path / 'b'}")  # fmt: skip
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "b")
    assert sorted(resumed) == [5, 6, 7] and all(len(v) == 1 for v in resumed.values())
    assert resumed == {step: straight[step] for step in (5, 6, 7)}
    assert_same_state(tmp_path / "straight/checkpoints/last.ckpt", tmp_path / "b/checkpoints/last.ckpt")
