"""NaNGuard's two stops, each by its own path: non-finite gradients (NaN/inf, or a norm that overflows float32) and a
finite loss that climbs far above its running level (a slow moving average, not the all-time minimum).

The loss-level sequences are per-optimizer-step mean losses; `drive` feeds them as Lightning would."""

import csv
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import TINY_RUN, train

from ddpm.callbacks.nan_guard import LEGACY, DivergenceError, NaNGuard, NonFiniteLossError

BASE = 0.05  # a trained diffusion loss
STEADY = [BASE] * 1000  # 1,000 steps at it: two time constants of the level


def drive(guard: NaNGuard, losses: list[float], grad_scale: float = 1.0) -> None:
    """Feed `guard` one optimizer step per loss (batch end, then the next step's check)."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    checkpoint = SimpleNamespace(last_model_path="run/checkpoints/last.ckpt")
    trainer = SimpleNamespace(global_step=0, checkpoint_callback=checkpoint, fast_dev_run=False,
                              strategy=SimpleNamespace(reduce=lambda x, reduce_op: x),
                              _logger_connector=SimpleNamespace(should_update_logs=True))  # fmt: skip
    module = SimpleNamespace(log=lambda *a, **k: None)
    for step, loss in enumerate(losses):
        trainer.global_step = step
        param.grad = torch.full((4,), grad_scale)
        guard.on_before_optimizer_step(trainer, module, optimizer)
        guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(float(loss))}, None, step)


def lognormal(level: float, sigma: float, n: int, seed: int = 0) -> list[float]:
    """`n` heavy-tailed losses: `level` x exp(N(0, sigma^2)) (median `level`; sigma 1 puts 1 in 100 above 10x)."""
    return (level * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))).tolist()


# --- a loss that rises for good reasons is not divergence ----------------------------------------------------------


def test_a_loss_that_steps_up_3x_and_stays_is_not_divergence_and_the_level_follows_it() -> None:
    """As after a resume with a higher LR: the old all-time minimum stayed at 0.05 for ever; a 500-step average is
    at the new loss after a few time constants (its distance shrinks as exp(-steps / 500))."""
    guard = NaNGuard(divergence_patience=1)  # not one step counted as diverging
    drive(guard, STEADY + [3 * BASE] * 3000)
    assert guard.above == 0
    assert guard.level == pytest.approx(3 * BASE, rel=0.01)


def test_a_loss_that_climbs_slowly_for_thousands_of_steps_is_not_divergence() -> None:
    """10x per 3,000 steps. On a ramp of slope s in log-loss, a debiased EMA of beta lags by s * beta / (1 - beta):
    9 steps for the fast average, 499 for the level, so the fast one sits exp(s * 490) = 1.458x above the level."""
    slope = math.log(10) / 3000
    guard = NaNGuard(divergence_patience=1)
    drive(guard, [BASE * math.exp(slope * i) for i in range(6000)])
    assert guard.above == 0
    assert math.exp(guard.fast - guard.slow) == pytest.approx(math.exp(slope * 490), rel=0.01)


def test_heavy_tailed_noise_around_a_level_never_stops_the_run() -> None:
    """Lognormal batch losses, sigma 1 (spikes to 40x the median in 5,000 steps): the 10-step average of log-loss
    has a standard deviation of sigma * sqrt(0.1 / 1.9) = 0.23, ten of them below log(10)."""
    losses = lognormal(BASE, 1.0, 5000)
    assert max(losses) > 20 * BASE  # the tail is there
    guard = NaNGuard(divergence_patience=1)
    drive(guard, losses)
    assert guard.above == 0
    assert guard.level == pytest.approx(BASE, rel=0.25)  # the median of the lognormal: log-loss averages to it


def test_a_lucky_stretch_does_not_lower_the_bar_for_good() -> None:
    """100 steps at 1/12 of the loss, then back to it: the old all-time minimum made every later batch a 12x
    divergence; the level dips by a fifth of the gap (1 - exp(-100 / 500)) and comes back."""
    guard = NaNGuard(divergence_patience=1)
    drive(guard, lognormal(BASE, 0.3, 1000) + [BASE / 12] * 100 + lognormal(BASE, 0.3, 2000, seed=1))
    assert guard.above == 0
    assert guard.level == pytest.approx(BASE, rel=0.1)


# --- a loss that diverges stops the run -----------------------------------------------------------------------------


@pytest.mark.parametrize("patience", [5, 20])
def test_a_loss_that_jumps_50x_and_stays_stops_after_the_lag_and_the_patience(patience: int) -> None:
    """The fast average (beta 0.9) crosses 10x the level on the k-th step at 50x, the first k with
    log(50) * (1 - 0.9**k) > log(10): k = 9. From there, `patience` steps."""
    lag = next(k for k in range(1, 100) if math.log(50) * (1 - 0.9**k) > math.log(10))
    assert lag == 9
    guard = NaNGuard(divergence_patience=patience)
    with pytest.raises(DivergenceError) as info:
        drive(guard, [*STEADY, *[50 * BASE] * 100])
    assert guard.fast_updates == len(STEADY) + lag - 1 + patience  # losses seen when it stopped
    assert guard.level == pytest.approx(BASE, rel=0.1)  # the divergence (and the lag) stayed out of the level
    message = str(info.value)
    assert message.startswith("the loss has diverged: its recent average") and "NaN" not in message
    assert "above 10x its running level 0.05" in message and f"for {patience} optimizer steps" in message
    assert "optim.lr" in message and "Last good checkpoint: run/checkpoints/last.ckpt" in message
    assert type(info.value) is DivergenceError


@pytest.mark.parametrize(
    ("before", "factor"),
    [([1.0] * 12, 50), ([BASE ** (i / 59) for i in range(60)], 100), ([BASE] * 2000, 11)],
    ids=["50x-at-step-12", "23x-its-level-after-a-falling-start", "11x-at-step-2000"],
)
def test_a_jump_early_in_a_run_or_just_over_the_factor_stops(before: list[float], factor: float) -> None:
    """Every loss entered the level clipped at the threshold: a level of few losses (early in a run) took those of
    a jump in faster than the fast average crossed, and an 11x step-up lifted the level past the fast average; none
    of these stopped within 2,000 steps. A loss above the threshold stays out of the level now."""
    guard = NaNGuard(divergence_patience=20)
    with pytest.raises(DivergenceError):
        drive(guard, [*before, *[factor * before[-1]] * 2000])
    assert guard.fast_updates <= len(before) + 60
    assert guard.level < 2 * statistics_level(before)  # the jump (at least 11x) stayed out of the level


def statistics_level(losses: list[float]) -> float:
    """The geometric mean of the last few hundred losses (about where a 500-step level of them sits)."""
    tail = losses[-500:]
    return math.exp(sum(map(math.log, tail)) / len(tail))


def test_a_noisy_loss_that_jumps_50x_stops_too() -> None:
    guard = NaNGuard(divergence_patience=20)
    with pytest.raises(DivergenceError):
        drive(guard, lognormal(BASE, 1.0, 1000) + lognormal(50 * BASE, 1.0, 200, seed=1))
    assert len(STEADY) + 20 <= guard.fast_updates <= len(STEADY) + 40


def test_a_loss_flickering_between_1000x_and_its_level_stops() -> None:
    """Every other batch back at the level: the old rule, which compared single batches and reset its count on
    each good one, never stopped this run (its geometric mean is 31.6x the level)."""
    guard = NaNGuard(divergence_patience=20)
    with pytest.raises(DivergenceError):
        drive(guard, STEADY + [1000 * BASE, BASE] * 100)
    assert guard.fast_updates <= len(STEADY) + 40


def test_steps_back_under_the_threshold_take_one_off_the_count_instead_of_resetting_it() -> None:
    """Blocks of 15 steps at 100x and 5 at the level: the fast average goes back under 10x on the 5th good step of
    each block, and a count reset there never gets past 19 (4 of the block's good steps are still above)."""
    guard = NaNGuard(divergence_patience=20)
    with pytest.raises(DivergenceError):
        drive(guard, STEADY + ([100 * BASE] * 15 + [BASE] * 5) * 20)
    assert guard.fast_updates <= len(STEADY) + 40


# --- non-finite gradients: the other path ---------------------------------------------------------------------------


def test_a_gradient_norm_that_overflows_float32_is_a_skipped_step() -> None:
    """Every element is finite (1e30) but the global 2-norm is 2e30 * ... > 3.4e38: clipping would zero the
    gradients and Adam would go on moving the weights on its moments. Such steps are skipped and stop the run."""
    grads = torch.full((4,), 1e30)
    assert grads.isfinite().all() and not math.isfinite(torch.linalg.vector_norm(grads).item())
    guard = NaNGuard(max_consecutive=3)
    with pytest.raises(NonFiniteLossError, match=r"NaN/inf .*overflowed.* 3 optimizer steps in a row, up to step 3"):
        drive(guard, [1.0] * 5, grad_scale=1e30)
    assert guard.skipped == 3


def test_clipping_reuses_the_guards_norm_and_clips_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """One global gradient norm per optimizer step: NaNGuard's, which DiffusionModule's clipping reuses; the
    clipped gradients equal torch.nn.utils.clip_grad_norm_'s bit for bit, and nothing of the step is left on the
    optimizer. Without the guard the clipping computes the norm itself, to the same gradients."""
    from ddpm.module import DiffusionModule

    def step(guarded: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 5), (7,), (2, 2, 2))]
        for p in params:
            p.grad = 10 * torch.randn_like(p)  # a norm far above the clip value of 1
        optimizer, calls = torch.optim.AdamW(params, fused=True), []
        monkeypatch.setattr(torch, "_foreach_norm", lambda *a, _norm=torch._foreach_norm, **k: calls.append(1)
                            or _norm(*a, **k))  # fmt: skip
        if guarded:
            trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(reduce=lambda x, reduce_op: x))
            NaNGuard().on_before_optimizer_step(trainer, SimpleNamespace(), optimizer)
        DiffusionModule.configure_gradient_clipping(None, optimizer, 1.0, "norm")  # type: ignore[arg-type]
        monkeypatch.undo()
        assert "grad_norm" not in vars(optimizer)
        return [p.grad for p in params], len(calls)

    torch.manual_seed(0)
    reference = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 5), (7,), (2, 2, 2))]
    for p in reference:
        p.grad = 10 * torch.randn_like(p)
    torch.nn.utils.clip_grad_norm_(reference, 1.0, foreach=True)
    for guarded in (True, False):
        grads, norms = step(guarded)
        assert norms == 1
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, reference, strict=True))


def test_a_trainer_fit_computes_one_gradient_norm_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Lightning's own hook order (the guard's on_before_optimizer_step, then the module's clipping, on the
    same optimizer object): a fit of 4 steps with the guard and clipping computes 4 global norms, not 8."""
    import lightning.pytorch as pl
    from helpers import tiny_unet

    from ddpm.data.ram import RAMDataModule
    from ddpm.data.sources import DigitsSource
    from ddpm.diffusion.gaussian import GaussianDiffusion
    from ddpm.module import DiffusionModule
    from ddpm.optim import AdamW

    pl.seed_everything(0, verbose=False)
    module = DiffusionModule(net=tiny_unet(num_classes=10), diffusion=GaussianDiffusion(num_timesteps=100),
                             optim=AdamW(lr=1e-3, warmup_steps=0))  # fmt: skip
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=8, limit=64, val_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=1.0, callbacks=[NaNGuard()])  # fmt: skip
    calls = []
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, _norm=torch._foreach_norm, **k: calls.append(1)
                        or _norm(*a, **k))  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4 and len(calls) == 4


def test_16_mixed_gradients_are_unscaled_before_the_guard_and_clipping() -> None:
    """Under 16-mixed Lightning leaves the gradients of a fused optimizer (ours) scaled by the GradScaler's scale, for
    the kernel to unscale: the guard's norm read 65536 x the true norm and clipping cut every step to 1 / 65536 of
    the clip value. A GradScaler starting at scale 1 (no scaling) is the truth: the guard's norms and the weights
    after 3 clipped steps of 2 accumulated micro-batches agree. On CPU Lightning turns precision=16-mixed into bf16,
    so the fp16 plugin is handed over as a GPU run builds it."""
    import lightning.pytorch as pl
    from helpers import tiny_unet
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ddpm.data.ram import RAMDataModule
    from ddpm.data.sources import DigitsSource
    from ddpm.diffusion.gaussian import GaussianDiffusion
    from ddpm.module import DiffusionModule
    from ddpm.optim import AdamW

    class Norms(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.seen.append(float(optimizer.grad_norm))  # the guard's, set just before (callback order)

    def fit(scale: float) -> tuple[list[float], torch.Tensor]:
        pl.seed_everything(0, verbose=False)
        module = DiffusionModule(net=tiny_unet(), diffusion=GaussianDiffusion(num_timesteps=100),
                                 optim=AdamW(lr=1e-3, warmup_steps=0))  # fmt: skip
        before = torch.cat([p.detach().flatten() for p in module.net.parameters()])
        data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=8, limit=64, val_size=8)
        norms = Norms()
        norms.seen = []
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, num_sanity_val_steps=0,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, gradient_clip_val=0.01, accumulate_grad_batches=2,
                             plugins=[plugin], callbacks=[NaNGuard(), norms])  # fmt: skip
        trainer.fit(module, datamodule=data)
        assert trainer.precision_plugin.scaler.get_scale() == scale  # no step overflowed: none was skipped
        return norms.seen, float((torch.cat([p.detach().flatten() for p in module.net.parameters()]) - before).norm())

    (norms, moved), (true_norms, true_moved) = fit(2.0**16), fit(1.0)
    assert len(norms) == 3 and min(true_norms) > 0.01  # clipping bites on every step
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(true_norms), rtol=1e-2, atol=0)
    assert moved == pytest.approx(true_moved, rel=0.05)


def test_the_grad_scalers_own_skips_under_16_mixed_are_not_faults() -> None:
    """A GradScaler whose scale is too high for the model skips steps while it halves the scale (torch's AMP: normal
    at the start of fp16 training, and after each growth): the guard counted each in `consecutive` and stopped a
    healthy run blaming NaN/fp16. Overflowing gradients with a finite loss while the scale is above 1 are skipped
    and counted in train/skipped_steps, not towards max_consecutive; a NaN loss, or an overflow at scale <= 1, is."""
    import lightning.pytorch as pl
    from helpers import tiny_unet
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ddpm.data.ram import RAMDataModule
    from ddpm.data.sources import DigitsSource
    from ddpm.diffusion.gaussian import GaussianDiffusion
    from ddpm.module import DiffusionModule
    from ddpm.optim import AdamW

    pl.seed_everything(0, verbose=False)
    module = DiffusionModule(net=tiny_unet(), diffusion=GaussianDiffusion(num_timesteps=100),
                             optim=AdamW(lr=1e-3, warmup_steps=0))  # fmt: skip
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=8, limit=128, val_size=8)
    guard = NaNGuard(max_consecutive=3)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1, plugins=[plugin],
                         callbacks=[guard])  # fmt: skip
    trainer.fit(module, datamodule=data)  # raised NonFiniteLossError at step 3
    assert guard.skipped >= 3 and trainer.precision_plugin.scaler.get_scale() < 2.0**40
    for entry, stops in (([math.inf, 0.5, 2.0**16], False), ([math.inf, math.nan, 2.0**16], True),
                         ([math.inf, 0.5, 1.0], True), ([math.nan, 0.5, 1.0], True)):  # fmt: skip
        guard = NaNGuard(max_consecutive=3)
        guard._history = [(step, torch.tensor(entry)) for step in range(3)]
        if stops:
            with pytest.raises(NonFiniteLossError):
                guard.check()
        else:
            guard.check()
            assert (guard.skipped, guard.consecutive) == (3, 0)


class ConstantLoss:
    """A LightningModule whose every micro-batch loss is 2.0 (with a gradient)."""

    @staticmethod
    def module():
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Linear(1, 1)

            def training_step(self, batch, batch_idx):
                return 0.0 * self.net(batch).sum() + 2.0

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

            def train_dataloader(self):
                return torch.utils.data.DataLoader(torch.ones(64, 1), batch_size=2)

        return Module()


@pytest.mark.parametrize("accumulate", [1, 4])
def test_the_guards_level_is_the_loss_under_gradient_accumulation(accumulate: int) -> None:
    """Lightning hands on_train_batch_end the loss divided by accumulate_grad_batches; the guard's level (and so
    its threshold) is the loss itself at any accumulation (before: 4x too low at 4, so a resume at accumulation 1
    with the same global batch looked like a 4x jump)."""
    import lightning.pytorch as pl

    guard = NaNGuard()
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, accumulate_grad_batches=accumulate, log_every_n_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[guard])  # fmt: skip
    trainer.fit(ConstantLoss.module())
    guard.check(trainer)
    assert guard.slow_updates >= 5 and guard.level == pytest.approx(2.0)


# --- the state in checkpoints ---------------------------------------------------------------------------------------


def test_a_resumed_guard_stops_exactly_where_the_straight_one_does() -> None:
    """The state (both averages, their counts, the count above, the losses not yet checked) is complete: a guard
    rebuilt from a state_dict halfway goes on exactly as the one that never stopped."""
    losses = lognormal(BASE, 0.5, 800) + lognormal(30 * BASE, 0.5, 100, seed=1)
    straight = NaNGuard(divergence_patience=10)
    with pytest.raises(DivergenceError) as expected:
        drive(straight, losses)
    first = NaNGuard(divergence_patience=10)
    drive(first, losses[:814])
    assert first.above > 0 and first.state_dict()["pending"] == [pytest.approx(losses[813])]
    resumed = NaNGuard(divergence_patience=10)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    with pytest.raises(DivergenceError) as got:
        drive(resumed, losses[814:])
    assert resumed.state_dict() == straight.state_dict()
    assert str(got.value).split(", up to step")[0] == str(expected.value).split(", up to step")[0]


def test_a_state_saved_before_the_slow_level_loads_and_drops_its_minimum() -> None:
    """The old state: a biased beta-0.98 average of the loss (debiased: 0.049 after 300 updates) and the lowest
    one (0.001, from a lucky stretch), against which every loss of 0.05 was a 50x divergence."""
    old = {"skipped": 2, "consecutive": 1, "average": 0.049 * (1 - 0.98**300), "updates": 300, "level": 0.001,
           "above": 3}  # fmt: skip
    assert set(old) == set(LEGACY)
    guard = NaNGuard(divergence_patience=1)
    guard.load_state_dict(old)
    assert (guard.skipped, guard.consecutive, guard.above) == (2, 1, 0)
    assert guard.level == pytest.approx(0.049)
    drive(guard, [BASE] * 200)
    assert guard.above == 0 and guard.level == pytest.approx(BASE, rel=0.01)
    with pytest.raises(DivergenceError):
        drive(guard, [50 * BASE] * 50)


def test_a_state_of_unknown_shape_is_refused_naming_the_keys() -> None:
    state = NaNGuard().state_dict() | {"window": [1.0]}
    with pytest.raises(ValueError, match=r"'window'.*another version of ddpm.callbacks.nan_guard"):
        NaNGuard().load_state_dict(state)


# --- real train.py runs: each path stops its own divergence ---------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return [r for r in csv.DictReader(f) if r.get("train/loss")]


def assert_checkpoints_finite(run_dir: Path) -> None:
    paths = list((run_dir / "checkpoints").glob("*.ckpt"))
    assert paths, "no checkpoint was written before the stop"
    for path in paths:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(v.isfinite().all() for v in state.values()), path


@pytest.mark.slow
def test_train_py_with_a_high_but_finite_lr_is_stopped_by_the_loss_level(tmp_path: Path) -> None:
    """optim.lr=0.7 (3,500x the default) from step 0: the loss jumps to 4-500x its first value (1.0: the output
    layer starts at zero) and stays there, every loss and gradient norm finite (clipped at 1.0, never skipped), so
    the NaN path never fires; the level detector stops the run after its 10-step warm-up and 5 steps of patience."""
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "trainer.max_steps=60", "trainer.val_check_interval=60", "callbacks.sample_grid=null",
                 "callbacks.checkpoint.every_n_train_steps=5", "optim.lr=0.7", "optim.warmup_steps=0",
                 "callbacks.nan_guard.divergence_patience=5", f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = train(*overrides, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "DivergenceError: the loss has diverged" in output, output[-3000:]
    assert "NonFiniteLossError" not in output and "NaN/inf" not in output
    stop = re.search(r"above 10x its running level .* for 5 optimizer steps, up to step (\d+) \(0 skipped", output)
    assert stop, output[-3000:]
    assert "lower optim.lr" in output and f"Last good checkpoint: {run_dir / 'checkpoints'}" in output
    rows = read_metrics(run_dir)
    losses = [float(r["train/loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses) and max(losses) > 100 * losses[0]  # it blew up, finite
    assert all(math.isfinite(float(r["train/grad_norm"])) for r in rows if r.get("train/grad_norm"))
    assert all(float(r["train/skipped_steps"]) == 0 for r in rows if r.get("train/skipped_steps"))
    assert max(int(r["step"]) for r in rows) < 30 and int(stop.group(1)) < 30  # long before max_steps
    assert_checkpoints_finite(run_dir)


@pytest.mark.slow
def test_train_py_with_an_absurd_lr_is_stopped_by_the_non_finite_path(tmp_path: Path) -> None:
    """The review's run: optim.lr=1e12 optim.warmup_steps=0 logged train/loss 3.5e28 and an inf grad norm and went
    on for ever. Its gradients overflow: the steps are skipped and the run stops, naming the LR, checkpoints intact."""
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "trainer.max_steps=300", "callbacks.checkpoint.every_n_train_steps=10",
                 "callbacks.sample_grid=null", "trainer.val_check_interval=50"]  # fmt: skip
    result = train(*overrides, "optim.lr=1e12", "optim.warmup_steps=0", f"hydra.run.dir={run_dir}", check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "NonFiniteLossError: the loss or gradients were NaN/inf" in output, output[-3000:]
    assert "DivergenceError: the loss has diverged" not in output
    assert re.search(r"in a row, up to step \d+", output) and "lower optim.lr" in output
    assert f"Last good checkpoint: {run_dir / 'checkpoints'}" in output
    assert max(int(r["step"]) for r in read_metrics(run_dir)) < 150  # stopped, long before max_steps
    assert_checkpoints_finite(run_dir)
