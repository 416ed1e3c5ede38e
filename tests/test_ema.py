"""The EMA callback against the closed-form recursion, under gradient accumulation and through checkpoints."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpm.callbacks.ema import EMA, ema_decay, schedule_note, warmup_reaches
from ddpm.weights.model import CHECKPOINT_KEY


class Scalar(nn.Module):
    """One parameter w, a float buffer b and an integer buffer k, all set by hand."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros((), dtype=dtype))
        self.register_buffer("b", torch.zeros((), dtype=dtype))
        self.register_buffer("k", torch.zeros((), dtype=torch.int64))

    def set(self, w: float, b: float, k: int) -> None:
        with torch.no_grad():
            self.w.fill_(w), self.b.fill_(b), self.k.fill_(k)


def closed_form(initial: float, values: list[float], decay: float, warmup: bool) -> float:
    """shadow_0 = initial; update n (0-based): d_n = min(decay, (1+n)/(10+n)), s <- d_n s + (1 - d_n) p."""
    shadow = initial
    for n, p in enumerate(values):
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        shadow = d * shadow + (1 - d) * p
    return shadow


def set_up(net: nn.Module, **kwargs) -> EMA:
    ema = EMA(**kwargs)
    ema.setup(None, SimpleNamespace(net=net), "fit")
    return ema


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("decay", [0.9, 0.999])
def test_update_matches_closed_form(decay, warmup):
    """After each update the shadow of w and of the float buffer b equals the float64 recursion."""
    net = Scalar()
    net.set(2.0, -1.0, 0)
    ema = set_up(net, decay=decay, warmup=warmup)
    values = [float(v) for v in torch.linspace(-3, 5, 40, dtype=torch.float64).tolist()]
    for n, p in enumerate(values):
        net.set(p, 10 * p, n + 1)
        ema.update(net)
        assert ema.num_updates == n + 1
        w_expected = closed_form(2.0, values[: n + 1], decay, warmup)
        b_expected = closed_form(-1.0, [10 * v for v in values[: n + 1]], decay, warmup)
        assert ema.shadow["w"].item() == pytest.approx(w_expected, rel=1e-5, abs=1e-5)
        assert ema.shadow["b"].item() == pytest.approx(b_expected, rel=1e-5, abs=1e-5)
        assert ema.shadow["k"].item() == n + 1  # integer buffers are copied, not averaged


def test_first_warmup_update_uses_decay_0_1():
    """n=0 gives d = min(decay, 1/10): the first update moves 90% of the way to the weights."""
    net = Scalar()
    ema = set_up(net, decay=0.9999)
    net.set(1.0, 0.0, 0)
    ema.update(net)
    assert ema.shadow["w"].item() == pytest.approx(0.9, rel=1e-6)


def test_shadow_float32_for_low_precision_weights():
    """bfloat16 weights get a float32 shadow averaged in float32, not rounded to bfloat16."""
    net = Scalar(dtype=torch.bfloat16)
    ema = set_up(net, decay=0.9, warmup=False)
    assert all(v.dtype == torch.float32 for k, v in ema.shadow.items() if k != "k")
    assert ema.shadow["k"].dtype == torch.int64  # integer buffers keep their dtype (copied, not averaged)
    for _ in range(3):
        net.set(1.0, 1.0, 0)  # 1.0 is exact in bfloat16
        ema.update(net)
    expected = 1 - 0.9**3  # 0.271: bfloat16 would round it to 0.2715
    assert ema.shadow["w"].item() == pytest.approx(expected, rel=1e-6)
    assert ema.shadow["b"].item() == pytest.approx(expected, rel=1e-6)
    assert ema.shadow["w"].dtype == torch.float32


def test_averaged_swaps_and_restores():
    """averaged() puts the shadow into the net, restores the raw weights after, and leaves the shadow alone."""
    net = Scalar()
    net.set(0.0, 0.0, 0)
    ema = set_up(net, decay=0.5, warmup=False)
    net.set(4.0, 8.0, 3)
    ema.update(net)  # shadow w = 2, b = 4, k = 3
    net.set(7.0, 9.0, 5)
    shadow_before = {k: v.clone() for k, v in ema.shadow.items()}
    w_param = net.w
    with ema.averaged(net):
        assert (net.w.item(), net.b.item(), net.k.item()) == (2.0, 4.0, 3)
        assert net.w is w_param  # copied in place, the Parameter object is kept
    assert (net.w.item(), net.b.item(), net.k.item()) == (7.0, 9.0, 5)
    assert all(torch.equal(ema.shadow[k], v) for k, v in shadow_before.items())


def test_averaged_restores_after_exception():
    """The raw weights come back even when the block raises."""
    net = Scalar()
    ema = set_up(net)
    net.set(3.0, 0.0, 0)
    with pytest.raises(RuntimeError), ema.averaged(net):
        raise RuntimeError("boom")
    assert net.w.item() == 3.0


def test_checkpoint_hooks_round_trip():
    """on_save_checkpoint writes an independent copy under ema_state_dict; on_load_checkpoint restores it exactly."""
    net = Scalar()
    ema = set_up(net, decay=0.9)
    for p in (1.0, 2.0, 3.0):
        net.set(p, -p, 1)
        ema.update(net)
    saved = {k: v.clone() for k, v in ema.shadow.items()}
    checkpoint = {}
    ema.on_save_checkpoint(None, None, checkpoint)
    assert set(checkpoint[CHECKPOINT_KEY]) == {"w", "b", "k"}
    net.set(100.0, 100.0, 9)
    ema.update(net)  # the saved copy must not move with the live shadow
    assert all(torch.equal(checkpoint[CHECKPOINT_KEY][k], v) for k, v in saved.items())

    fresh = set_up(Scalar(), decay=0.9)
    fresh.load_state_dict(ema.state_dict())
    fresh.on_load_checkpoint(None, None, checkpoint)
    assert all(torch.equal(fresh.shadow[k], v) for k, v in saved.items())
    assert fresh.num_updates == ema.num_updates


def test_checkpoint_mismatch_raises():
    """EMA weights for another model are refused with a ValueError."""
    ema = set_up(Scalar())
    with pytest.raises(ValueError, match="do not match"):
        ema.on_load_checkpoint(None, None, {CHECKPOINT_KEY: {"w": torch.zeros(())}})


class Tiny(pl.LightningModule):
    """Linear regression; `net` is what the EMA averages."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


def trainer(tmp_path, max_steps: int, ema: EMA, accumulate: int = 4) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        callbacks=[ema],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


class Recorder(pl.Callback):
    """Records the weight after each optimizer step (what the EMA should average)."""

    def __init__(self) -> None:
        self.steps, self.weights = [0], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step != self.steps[-1]:
            self.steps.append(trainer.global_step)
            self.weights.append(pl_module.net.weight.detach().clone().double())


def test_updates_count_optimizer_steps_under_accumulation(tmp_path):
    """accumulate_grad_batches=4, max_steps=5: 5 EMA updates (20 micro-batches), shadow = closed form."""
    pl.seed_everything(0, verbose=False)
    ema, recorder = EMA(decay=0.9), Recorder()
    module = Tiny()
    initial = module.net.weight.detach().clone().double()
    t = trainer(tmp_path, max_steps=5, ema=ema)
    t.callbacks.insert(0, recorder)
    t.fit(module, loader())
    assert t.global_step == 5 and t.fit_loop.epoch_loop.batch_progress.total.completed == 20
    assert ema.num_updates == 5 and recorder.steps == [0, 1, 2, 3, 4, 5]
    expected = initial
    for n, weight in enumerate(recorder.weights):
        d = min(0.9, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * weight
    torch.testing.assert_close(ema.shadow["weight"].double(), expected, rtol=1e-5, atol=1e-6)


def test_update_every_n_steps_under_accumulation(tmp_path):
    """update_every_n_steps=2 with 6 optimizer steps (24 micro-batches) gives 3 updates."""
    pl.seed_everything(0, verbose=False)
    ema = EMA(decay=0.9, update_every_n_steps=2)
    trainer(tmp_path, max_steps=6, ema=ema).fit(Tiny(), loader())
    assert ema.num_updates == 3


def test_checkpoint_file_round_trip(tmp_path):
    """A checkpoint written by the Trainer holds ema_state_dict; resuming from it restores the shadow exactly."""
    pl.seed_everything(0, verbose=False)
    ema = EMA(decay=0.9)
    first = trainer(tmp_path, max_steps=3, ema=ema)
    first.fit(Tiny(), loader())
    path = tmp_path / "ema.ckpt"
    first.save_checkpoint(path)
    saved = {k: v.clone() for k, v in ema.shadow.items()}
    on_disk = torch.load(path, weights_only=False)[CHECKPOINT_KEY]
    assert all(torch.equal(on_disk[k], v) for k, v in saved.items())

    pl.seed_everything(1, verbose=False)
    resumed = EMA(decay=0.9)
    trainer(tmp_path, max_steps=3, ema=resumed).fit(Tiny(), loader(), ckpt_path=path)  # nothing left to train
    assert resumed.num_updates == 3
    assert saved.keys() == resumed.shadow.keys()
    assert all(torch.equal(resumed.shadow[k], v) for k, v in saved.items())


class SavesDuringValidation(Tiny):
    """Writes a checkpoint from inside validation, as Lightning's SLURM requeue handler does from its signal."""

    def __init__(self, path) -> None:
        super().__init__()
        self.path = path

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking and not self.path.exists():
            self.trainer.save_checkpoint(self.path)


def test_a_checkpoint_written_during_validation_holds_the_trained_weights_not_the_ema(tmp_path):
    """Validation runs with the EMA weights swapped into the net; a checkpoint written then (SLURM's requeue
    handler saves whenever its signal comes) resumed training from the EMA weights."""
    pl.seed_everything(0, verbose=False)
    ema, module, trained = EMA(decay=0.9, warmup=False), SavesDuringValidation(tmp_path / "during.ckpt"), {}
    probe = pl.Callback()  # before the EMA callback: sees the net's own weights before the swap
    probe.on_validation_epoch_start = lambda t, m: trained.update({k: v.clone() for k, v in m.net.state_dict().items()})
    fit = pl.Trainer(accelerator="cpu", max_steps=4, val_check_interval=4, limit_val_batches=1, logger=False,
                     callbacks=[probe, ema], enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)  # fmt: skip
    fit.fit(module, loader(), loader())
    saved = torch.load(tmp_path / "during.ckpt", weights_only=False)
    for k in ("weight", "bias"):
        assert torch.equal(saved["state_dict"][f"net.{k}"], trained[k])
        assert not torch.equal(trained[k], saved[CHECKPOINT_KEY][k])  # the EMA differs: the check can fail
        assert torch.equal(module.net.state_dict()[k], trained[k])  # and the net has its own weights back


class FailsInValidation(Tiny):
    def validation_step(self, batch, batch_idx):
        raise RuntimeError("validation failed")


def test_a_validation_that_raises_leaves_the_net_its_own_weights(tmp_path):
    """The swap back happens at the validation epoch's end, which an error skips: the net kept the EMA weights."""
    pl.seed_everything(0, verbose=False)
    ema, module, trained = EMA(decay=0.9, warmup=False), FailsInValidation(), {}
    probe = pl.Callback()  # before the EMA callback: sees the net's own weights before the swap
    probe.on_validation_epoch_start = lambda t, m: trained.update({k: v.clone() for k, v in m.net.state_dict().items()})
    fit = pl.Trainer(accelerator="cpu", max_steps=4, val_check_interval=4, limit_val_batches=1, logger=False,
                     callbacks=[probe, ema], enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(RuntimeError, match="validation failed"):
        fit.fit(module, loader(), loader())
    assert all(torch.equal(module.net.state_dict()[k], v) for k, v in trained.items())
    assert not torch.equal(trained["weight"], ema.shadow["weight"]) and ema._trained == []


def test_resuming_a_checkpoint_without_ema_weights_starts_the_ema_from_its_weights(tmp_path):
    """The shadow is made in setup, before the Trainer loads the checkpoint into the net: without ema_state_dict
    it held the new module's random initial weights, not the checkpoint's as the warning says."""
    pl.seed_everything(0, verbose=False)
    first = trainer(tmp_path, max_steps=3, ema=EMA(decay=0.9))
    first.fit(Tiny(), loader())
    path = tmp_path / "no_ema.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, path)
    pl.seed_everything(1, verbose=False)
    resumed = EMA(decay=0.9)
    with pytest.warns(UserWarning, match="holds no EMA weights"):
        trainer(tmp_path, max_steps=3, ema=resumed).fit(Tiny(), loader(), ckpt_path=path)  # nothing left to train
    for k in ("weight", "bias"):
        assert torch.equal(resumed.shadow[k], checkpoint["state_dict"][f"net.{k}"])


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9, 0.99, 0.995, 0.998, 0.999, 0.9995, 0.9999])
def test_warmup_reaches_the_first_update_at_the_decay(decay):
    """Against a scan of the closed form (1 + n) / (10 + n) >= d (n >= (10 d - 1) / (1 - d): 8,990 for 0.999)."""
    first = next(n for n in range(200_000) if min(decay, (1 + n) / (10 + n)) == decay)
    assert warmup_reaches(decay) == first
    assert ema_decay(decay, first, warmup=True) == decay > ema_decay(decay, max(first - 1, 0), True) or first == 0


def test_schedule_note_says_when_a_short_run_never_reaches_the_decay():
    """experiment=mnist: 2,000 updates at 0.999 end at 2000/2009; 0.998 and 0.999 train the same average there."""
    note = schedule_note(0.999, 2000)
    assert "stays below ema.decay=0.999 for all 2,000 updates" in note and "8,990" in note and "2000/2009" in note
    assert "0.9999 from update 89,990 of 800,000" in schedule_note(0.9999, 800_000)
    assert "stays below" not in schedule_note(0.9, float("inf"))
    values = [float(v) for v in torch.linspace(-1, 1, 2000)]
    assert closed_form(0.0, values, 0.999, True) == closed_form(0.0, values, 2000 / 2009, True)
    assert closed_form(0.0, values, 0.999, True) != closed_form(0.0, values, 0.995, True)


def test_fit_logs_the_schedule(tmp_path, caplog):
    """A 5-update fit at decay 0.9 (reached at update 80) logs that the warm-up keeps it below 0.9 throughout."""
    with caplog.at_level("INFO"):
        trainer(tmp_path, max_steps=5, ema=EMA(decay=0.9), accumulate=1).fit(Tiny(), loader())
    assert "stays below ema.decay=0.9 for all 5 updates" in caplog.text and "from update 80" in caplog.text


class StopAfter(pl.Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def test_a_fit_without_a_step_or_epoch_limit_trains(tmp_path, caplog):
    """max_steps=-1 with max_epochs=-1 (stopped by max_time, a signal or a callback): Lightning's
    estimated_stepping_batches is inf, and inf // n is NaN, which int() refused before the first step."""
    ema = EMA(decay=0.9, update_every_n_steps=2)
    fit = pl.Trainer(accelerator="cpu", max_steps=-1, max_epochs=-1, callbacks=[ema, StopAfter(4)], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path)  # fmt: skip
    with caplog.at_level("INFO"):
        fit.fit(Tiny(), loader())
    assert fit.global_step == 4 and ema.num_updates == 2
    assert "0.9 from update 80" in caplog.text and "stays below" not in caplog.text


def test_a_new_average_starts_from_the_weights_the_fit_starts_with():
    """setup() runs before DDP copies rank 0's weights to every rank: with seed=null each rank's average began at
    its own random weights (ema.warmup=false kept that share for ~1/(1-d) steps). on_fit_start takes them again."""
    net = nn.Linear(2, 1)
    ema = set_up(net, decay=0.9)
    with torch.no_grad():
        net.weight.fill_(3.0)  # what DDP's broadcast of rank 0's weights does between setup and on_fit_start
    ema.on_fit_start(None, SimpleNamespace(net=net, device=torch.device("cpu")))
    assert torch.equal(ema.shadow["weight"], net.weight.detach())
    ema.update(net)
    with torch.no_grad():
        net.weight.fill_(5.0)
    ema.on_fit_start(None, SimpleNamespace(net=net, device=torch.device("cpu")))  # a second fit keeps its average
    assert torch.equal(ema.shadow["weight"], torch.full((1, 2), 3.0))


def test_an_average_that_would_take_no_update_is_refused_or_holds_the_trained_weights(tmp_path):
    """ema.update_every_n_steps above the run's steps left the average at the initial weights: validation, grids
    and ema.pt used an untrained network (the UNet's zeroed output conv: every sample the same). Refused before step
    1; a run stopped before its first update (max_time, a signal) ends with the trained weights in the average."""
    with pytest.raises(ValueError, match=r"ema.update_every_n_steps=10 exceeds the run's 3 steps.*<= 3"):
        trainer(tmp_path, max_steps=3, ema=EMA(update_every_n_steps=10), accumulate=1).fit(Tiny(), loader())
    ema = EMA(decay=0.9, update_every_n_steps=10)
    fit = pl.Trainer(accelerator="cpu", max_steps=-1, max_epochs=-1, callbacks=[ema, StopAfter(4)], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path)  # fmt: skip
    module = Tiny()
    with pytest.warns(UserWarning, match="took no update in 4 steps"):
        fit.fit(module, loader())
    assert ema.num_updates == 0 and torch.equal(ema.shadow["weight"], module.net.weight.detach())
