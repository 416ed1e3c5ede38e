"""Issue 36, classes 2 and 4: a failed job never takes a sweep down, and errors arrive before the work.

- A grid sweep (`-m`) with failed jobs: each failed job's status and one-line error are in its result.json and
  in summary.csv, which is written after every job and whatever the end; the sweep exits 1.
- An Optuna study: a failed trial is told FAIL and the study goes on, until `hydra.sweeper.max_failures`.
- `objective` is checked against the metrics the run logs before anything is built or trained.
- `tune=lr_find` warns when the loss minimum is at an edge of the tested range.
"""

import atexit
import csv
import json
import math
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_RUN, compose, train, wandb_dirs
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ddpm.objective import check_objective, fid_metrics, logged_metrics, never_validates
from ddpm.sweep import SUMMARY_FILE, SweepSummary

TINY_SWEEP = [*TINY_RUN, "callbacks.sample_grid=null", "optim.warmup_steps=0", "callbacks.nan_guard.max_consecutive=2"]
CLASSIFIER_FID = ["+callbacks/fid=classifier", "callbacks.fid.features=c.pt"]  # the file is read at fit start only
DIVERGING_LR = 1e12  # with no warm-up: NaN/inf gradients from the first steps (docs/reliability.md, row 14b)


@pytest.fixture(autouse=True)
def no_hydra_config_left():
    """These tests set Hydra's global HydraConfig as a job would see it; later tests must not."""
    yield
    HydraConfig.instance().cfg = None


def job_config(sweep: Path, job: str, overrides: list[str]) -> DictConfig:
    """The config Hydra hands a multirun job's callbacks, with HydraConfig set as Hydra sets it."""
    cfg = compose("train", [*overrides, f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode, cfg.hydra.runtime.output_dir = RunMode.MULTIRUN, str(sweep / job)
    HydraConfig.instance().set_config(cfg)
    return cfg


def read_summary(sweep: Path) -> list[dict[str, str]]:
    with (sweep / SUMMARY_FILE).open() as f:
        return list(csv.DictReader(f))


def test_summary_csv_is_written_at_every_job_end_with_the_failed_jobs_error(tmp_path: Path) -> None:
    summary, sweep = SweepSummary(objective="val/loss"), tmp_path / "sweep"
    error = ValueError("optim.lr=-1 must be a positive finite number\n(2e-4 is the usual value)")
    failed = JobReturn(status=JobStatus.FAILED, _return_value=error)
    summary.on_job_end(job_config(sweep, "0", ["optim.lr=-1"]), failed)
    rows = read_summary(sweep)  # before any other job ends and before the multirun's end
    assert [(r["job"], r["optim.lr"], r["status"]) for r in rows] == [("0", "-1", "FAILED")]
    assert rows[0]["error"] == "ValueError: optim.lr=-1 must be a positive finite number (2e-4 is the usual value)"
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert result["status"] == "FAILED" and result["val/loss"] is None and result["error"] == rows[0]["error"]
    assert "ValueError: optim.lr=-1" in result["traceback"]

    summary.on_job_end(job_config(sweep, "1", ["optim.lr=1e-3"]), JobReturn(status=JobStatus.COMPLETED,
                                                                            _return_value=0.25))  # fmt: skip
    rows = read_summary(sweep)
    assert [(r["job"], r["status"], r["val/loss"], r["error"]) for r in rows] == [
        ("1", "COMPLETED", "0.25", ""),  # best first, the failed job last
        ("0", "FAILED", "", rows[1]["error"]),
    ]


def test_a_sweep_stopped_by_its_sweeper_prints_the_table_at_exit(tmp_path: Path, capsys, monkeypatch) -> None:
    """Hydra's BasicSweeper re-raises a failed job's error before on_multirun_end: the table comes at exit."""
    at_exit: list = []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    monkeypatch.setattr(atexit, "unregister", at_exit.remove)
    summary, sweep = SweepSummary(objective="val/loss"), tmp_path / "sweep"
    cfg = job_config(sweep, "0", ["optim.lr=-1"])
    summary.on_multirun_start(cfg)
    summary.on_job_end(cfg, JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom")))
    (report,) = at_exit
    report()  # what the interpreter calls at exit when the sweeper raised
    out = capsys.readouterr().out
    assert "Sweep summary" in out and "the sweep stopped with the error above" in out
    assert "RuntimeError: boom" in out and "1 of 1 jobs failed (0)" in out
    summary.on_multirun_end(cfg)  # a sweep that ends: the table once more, and no report at exit
    assert "the sweep stopped" not in capsys.readouterr().out and at_exit == []


@pytest.mark.slow
def test_a_grid_sweep_with_failed_jobs_records_them_writes_the_summary_and_exits_1(tmp_path: Path) -> None:
    """The issue's `optim.lr=-1,1e-3`, and a job that diverges mid-training, before the good job. With W&B (offline)
    each job has its own run: the diverged job's stayed open, and the next job logged into it."""
    sweep = tmp_path / "sweep"
    result = train("-m", *TINY_SWEEP, f"optim.lr={DIVERGING_LR},-1,1e-3", f"hydra.sweep.dir={sweep}",
                   "logger=[csv,wandb]", "logger.wandb.mode=offline", check=False,
                   extra_env=wandb_dirs(tmp_path))  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]  # documented: a sweep with a failed job exits 1
    rows = {r["job"]: r for r in read_summary(sweep)}
    assert [r["job"] for r in read_summary(sweep)] == ["2", "0", "1"]  # the completed job first
    assert rows["2"]["status"] == "COMPLETED" and math.isfinite(float(rows["2"]["val/loss"]))
    assert rows["0"]["status"] == "FAILED" and rows["0"]["error"].startswith("NonFiniteLossError: ")
    assert rows["1"]["status"] == "FAILED" and "optim.lr=-1 must be a positive" in rows["1"]["error"]
    assert [(sweep / job / "ema.pt").is_file() for job in "012"] == [False, False, True]
    assert "NonFiniteLossError" in json.loads((sweep / "0" / "result.json").read_text())["traceback"]
    assert "Sweep summary" in result.stdout and "2 of 3 jobs failed (0, 1)" in result.stdout
    assert [len(list((sweep / job / "wandb").glob("offline-run-*"))) for job in "02"] == [1, 1]
    for job in "012":  # each job's own files stay in its folder (a RUNNING result.json written before the job's
        assert (sweep / job / ".hydra").is_dir() and (sweep / job / "train.log").is_file()  # claim moved them aside)
        assert not list((sweep / job).glob("replaced-*")) and not (sweep / job / ".running").exists()


class ScriptedLauncher:
    """Runs no job: trial i returns outcomes[i] (an exception: the job failed)."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes, self.launched = outcomes, []

    def launch(self, overrides: list, initial_job_idx: int) -> list[JobReturn]:
        returns = []
        for i, job in enumerate(overrides, start=initial_job_idx):
            self.launched.append(i)
            outcome = self.outcomes[i]
            status = JobStatus.FAILED if isinstance(outcome, Exception) else JobStatus.COMPLETED
            returns.append(JobReturn(status=status, _return_value=outcome, overrides=list(job)))
        return returns


def scripted_study(tmp_path: Path, outcomes: list, *, max_failures: int | None, n_trials: int):
    import optuna

    from ddpm.optuna_sweeper import CappedStudy

    storage = optuna.storages.InMemoryStorage()
    study = CappedStudy(sampler=optuna.samplers.RandomSampler(seed=0), direction="minimize", storage=storage,
                        study_name="s", n_trials=n_trials, n_jobs=1, max_failures=max_failures,
                        params=OmegaConf.create({"optim.lr": "interval(1e-4, 1e-2)"}))  # fmt: skip
    study.launcher = ScriptedLauncher(outcomes)
    study.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    return study, lambda: optuna.load_study(study_name="s", storage=storage)


def test_optuna_failed_trials_are_recorded_and_the_study_goes_on(tmp_path: Path) -> None:
    from optuna.trial import TrialState

    outcomes = [RuntimeError("diverged"), 0.5, None, float("nan"), 0.25, RuntimeError("again")]
    study, load = scripted_study(tmp_path, outcomes, max_failures=None, n_trials=6)
    study.sweep([])
    states = [t.state for t in load().trials]
    F, C = TrialState.FAIL, TrialState.COMPLETE  # None (no validation ran) and NaN are failures too
    assert states == [F, C, F, F, C, F] and study.launcher.launched == list(range(6))
    assert load().best_value == 0.25
    assert yaml_best(tmp_path) == 0.25  # the plugin's optimization_results.yaml


def yaml_best(folder: Path) -> float:
    return OmegaConf.load(folder / "optimization_results.yaml").best_value


def test_optuna_stops_at_max_failures_naming_the_key_and_each_error(tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from ddpm.optuna_sweeper import TooManyFailedTrials

    outcomes = [0.5, RuntimeError("first cause"), 0.4, None, 0.3, 0.2]
    study, load = scripted_study(tmp_path, outcomes, max_failures=2, n_trials=6)
    with pytest.raises(TooManyFailedTrials) as stop:
        study.sweep([])
    message = str(stop.value)
    assert "hydra.sweeper.max_failures=2 reached: 2 of the 4 trials run failed" in message
    assert "trial 1 (optim.lr=" in message and "RuntimeError: first cause" in message
    assert "trial 3 (optim.lr=" in message and "returned no objective value (None)" in message
    assert study.launcher.launched == [0, 1, 2, 3]  # trials 4 and 5 never ran
    assert [t.state for t in load().trials] == [TrialState.COMPLETE, TrialState.FAIL] * 2  # none left RUNNING


def test_optuna_study_whose_trials_all_fail_ends_with_their_errors(tmp_path: Path) -> None:
    from ddpm.optuna_sweeper import TooManyFailedTrials

    study, _ = scripted_study(tmp_path, [ValueError("a"), ValueError("b")], max_failures=5, n_trials=2)
    with pytest.raises(TooManyFailedTrials, match=r"no trial of the study completed \(2 of the 2") as info:
        study.sweep([])
    assert "max_failures" not in str(info.value)  # under the cap: raising it would change nothing
    with pytest.raises(ValueError, match=r"hydra\.sweeper\.max_failures=0 must be >= 1"):
        scripted_study(tmp_path, [], max_failures=0, n_trials=1)


@pytest.mark.slow
def test_train_py_optuna_study_goes_on_past_diverging_trials_and_stops_at_the_cap(tmp_path: Path) -> None:
    """hparams_search=optuna over optim.lr in {1e-3, 1e12}: the 1e12 trials diverge (NaN guard); TPE's seed 42
    draws 1e12, 1e-3, 1e-3, 1e12: the study goes on past trial 0 and stops at the 2nd failure, before trial 4."""
    import optuna

    sweep = tmp_path / "study"
    fixed = ["data.batch_size=32", "ema.decay=0.999", "model.dropout=0.0"]  # given here: not searched
    result = train("hparams_search=optuna", "hydra.sweeper.n_trials=5", "hydra.sweeper.max_failures=2",
                   f"optim.lr=choice(0.001,{DIVERGING_LR})", *fixed, *TINY_SWEEP, f"hydra.sweep.dir={sweep}",
                   check=False, extra_env=wandb_dirs(tmp_path))  # fmt: skip
    trials = optuna.load_study(study_name="ddpm", storage=f"sqlite:///{sweep}/optuna.db").trials
    states = [(t.params["optim.lr"], t.state.name) for t in trials]
    assert states == [(DIVERGING_LR, "FAIL"), (1e-3, "COMPLETE"), (1e-3, "COMPLETE"), (DIVERGING_LR, "FAIL")]
    assert result.returncode == 1 and "hydra.sweeper.max_failures=2 reached" in result.stderr
    listed = re.findall(r"^  trial (\d) \(optim.lr=(\S+)\): (\w+): ", result.stderr, flags=re.M)
    assert listed == [("0", str(DIVERGING_LR), "NonFiniteLossError"), ("3", str(DIVERGING_LR), "NonFiniteLossError")]
    rows = read_summary(sweep)
    assert [r["status"] for r in rows] == ["COMPLETED", "COMPLETED", "FAILED", "FAILED"]
    assert all(r["error"].startswith("NonFiniteLossError: ") for r in rows[2:])


@pytest.mark.parametrize(
    ("overrides", "suggestion"),
    [
        (["objective=val/los"], "objective=val/loss"),  # the example
        (["objective=loss"], "objective=val/loss"),
        (["+callbacks/fid=inception", "callbacks.fid.num_samples=1000", "objective=val/fid@1000"], "val/fid@1k"),
        ([*CLASSIFIER_FID, "callbacks.fid.num_samples=500", "objective=val/fid@500"], "objective=val/cfid@500"),
        (["objective=val/cfid@500"], "+callbacks/fid=classifier"),  # no FID callback configured
    ],
)
def test_an_objective_the_run_never_logs_is_refused_before_anything_is_built(
    tmp_path: Path, monkeypatch, overrides: list[str], suggestion: str
) -> None:
    from ddpm import training

    monkeypatch.setattr(training, "claim_run", lambda *a, **k: pytest.fail("got past the objective's check"))
    cfg = compose("train", [*TINY_RUN, *overrides, f"paths.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="is not a metric this run logs") as refused:
        training.train(cfg)
    assert suggestion in str(refused.value) and "val/loss" in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_objectives_the_fid_callback_logs_are_the_names_compute_metrics_gives() -> None:
    """fid_metrics predicts the keys; ddpm.metrics.fid.compute_metrics (what the callback logs) is the truth."""
    from ddpm.metrics.fid import FeatureStats, compute_metrics

    torch.manual_seed(0)
    reference, features, logits = FeatureStats.of(torch.randn(64, 4)), torch.randn(20, 4), torch.randn(20, 10)
    for kind, node in [("inception", {"features": "inception"}), ("classifier", {"features": "c.pt"})]:
        for count, metrics in [(20, ["fid"]), (1000, ["fid", "kid", "is"])]:
            f = features.repeat(count // 20, 1) if count > 20 else features
            lg = logits.repeat(count // 20, 1) if count > 20 else logits
            labels = torch.arange(count) % 10
            logged = compute_metrics(metrics, features=f, logits=lg, reference=reference, kind=kind, labels=labels)
            predicted = fid_metrics(node | {"num_samples": count, "metrics": metrics}, conditional=True)
            assert sorted(predicted) == sorted(f"val/{name}" for name in logged), (kind, count)


def test_every_objective_the_configs_name_passes_the_check() -> None:
    for overrides in (
        [],
        ["hparams_search=mnist_quality", "callbacks.fid.features=c.pt", "model.num_classes=10"],
        [*CLASSIFIER_FID, "objective=val/cfid@1k"],
        ["objective=train/loss"],
    ):
        cfg = compose("train", [*overrides, "paths.output_dir=unused"])
        check_objective(OmegaConf.to_container(cfg, resolve=True))
    assert logged_metrics({"callbacks": {"fid": None}}) == ["val/loss", "train/loss"]


def test_accuracy_as_objective_needs_a_classifier_with_logits(tmp_path: Path) -> None:
    """val/accuracy@K is logged only by a classifier with logits: with one without, a run (every job of a sweep)
    trained to its end, then failed on an objective never logged."""
    from ddpm.metrics.classifier import SmallClassifier, save_torchscript

    features = tmp_path / "features_only.pt"
    torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))).save(str(features))
    with_logits = save_torchscript(SmallClassifier(in_channels=1, num_classes=10), tmp_path / "clf.pt", image_size=8)
    for path, logged in ((with_logits, True), (features, False)):
        cfg = compose("train", ["+callbacks/fid=classifier", f"callbacks.fid.features={path}", "model.num_classes=10",
                                "callbacks.fid.num_samples=500", "objective=val/accuracy@500",
                                "paths.output_dir=unused"])  # fmt: skip
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert ("val/accuracy@500" in logged_metrics(resolved)) is logged
        if not logged:
            with pytest.raises(ValueError, match=r"objective='val/accuracy@500' is not a metric this run logs"):
                check_objective(resolved)


def falling(n: int) -> list[float]:
    return [2.0 - i / n for i in range(n)]


def lr_range(n: int) -> list[float]:
    return [1e-7 * (1e-2 / 1e-7) ** (i / (n - 1)) for i in range(n)]


@pytest.mark.parametrize(
    ("losses", "edge"),
    [
        (falling(50), "max_lr"),  # the issue's: still falling at the last LR of the full range
        ([1.0 + i / 50 for i in range(50)], "min_lr"),  # rising from the first step considered (step 5 of 50)
        ([0.5] * 5 + [1.0 + i / 50 for i in range(45)], "min_lr"),  # lower only in the 5 skipped steps: the edge
        ([(i - 30) ** 2 / 100 + 1 for i in range(50)], None),  # a minimum inside the range
        ([(i - 30) ** 2 / 10 + 1 for i in range(41)], None),  # stopped early (4x its minimum): it turned up
        ([*falling(50)[:40], *[math.nan] * 10], None),  # turned NaN after its minimum: diverged, not an edge
    ],
)
def test_lr_find_warns_when_the_minimum_is_at_an_edge_of_the_range(losses: list[float], edge: str | None) -> None:
    from ddpm.tuning import LRRangeTest

    test = LRRangeTest(num_steps=50)
    result = test.summarize(lr_range(50)[: len(losses)], losses)
    finite = [i for i, v in enumerate(losses) if math.isfinite(v) and i >= 5]
    assert result.lr_at_min == lr_range(50)[min(finite, key=losses.__getitem__)]  # independent of the warning
    if edge is None:
        assert result.warning is None
    else:
        assert f"tune.lr_find.{edge}" in result.warning and "unreliable" in result.warning


def test_lr_find_run_warns_on_a_loss_that_never_turns_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finder's result as Lightning returns it (its smoothed, biased losses), through LRRangeTest.run."""
    from ddpm import tuning

    n, beta = 40, 0.98
    raw = falling(n)
    avg, smoothed = 0.0, []
    for i, loss in enumerate(raw):  # Lightning 2.6 _LRCallback's smoothing
        avg = beta * avg + (1 - beta) * loss
        smoothed.append(avg / (1 - beta ** (i + 2)))
    finder = SimpleNamespace(results={"lr": lr_range(n), "loss": smoothed})
    monkeypatch.setattr(tuning, "Tuner", lambda trainer: SimpleNamespace(lr_find=lambda *a, **k: finder))
    with pytest.warns(tuning.LRRangeWarning, match=r"still falling at the last LR tested .*tune.lr_find.max_lr"):
        result = tuning.LRRangeTest(num_steps=n, max_lr=1e-2).run(None, None, None)
    assert result.lr_at_min == lr_range(n)[-1] and result.suggestion == pytest.approx(1e-3)
    u_shaped = [(i - 25) ** 2 / 100 + 1 for i in range(n)]
    finder.results["loss"] = u_shaped
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.LRRangeWarning)
        assert tuning.LRRangeTest(num_steps=n).run(None, None, None).warning is None


def test_lr_find_json_records_the_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tune_lr on the real config, the finder's result replaced: lr_find.json keeps the warning with the curve."""
    from ddpm import tuning

    finder = SimpleNamespace(results={"lr": lr_range(30), "loss": falling(30)})
    monkeypatch.setattr(tuning, "Tuner", lambda trainer: SimpleNamespace(lr_find=lambda *a, **k: finder))
    cfg = compose("train", [*TINY_RUN, "tune=lr_find", "tune.lr_find.num_steps=30", f"paths.output_dir={tmp_path}"])
    with pytest.warns(tuning.LRRangeWarning):
        tuning.tune_lr(cfg, tmp_path, {"module": {"compile": False}})
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert record["lr_at_min"] == lr_range(30)[-1] and "tune.lr_find.max_lr" in record["warning"]


def test_lr_find_compiles_as_the_run_decided(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=auto is decided once for the run (trainer.accelerator's device); the range test's module resolved
    it again on the machine's default device (a GPU machine with trainer.accelerator=cpu compiled on the CPU)."""
    from ddpm import tuning

    seen = []
    finder = SimpleNamespace(results={"lr": lr_range(30), "loss": falling(30)})
    monkeypatch.setattr(tuning, "Tuner", lambda trainer: SimpleNamespace(
        lr_find=lambda module, *a, **k: seen.append(module.compile_mode) or finder))  # fmt: skip
    cfg = compose("train", [*TINY_RUN, "tune=lr_find", "tune.lr_find.num_steps=30", "compile=true",
                           f"paths.output_dir={tmp_path}"])  # fmt: skip
    tuning.tune_lr(cfg, tmp_path, {"module": {"compile": False}})  # as train() resolved `auto` for the device
    assert seen == [None]  # eager


@pytest.mark.parametrize(
    ("trainer", "refused"),
    [
        ({"max_steps": 6, "val_check_interval": 10}, "val_check_interval=6 or lower"),
        ({"max_steps": 6, "val_check_interval": 10, "accumulate_grad_batches": 2}, None),  # up to 12 batches
        ({"max_steps": 4, "val_check_interval": 9, "accumulate_grad_batches": 2}, "val_check_interval=4 or lower"),
        ({"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 0}, "limit_val_batches=0"),
        ({"max_steps": -1, "val_check_interval": 10}, None),  # no step limit
        ({"max_steps": 6, "val_check_interval": 0.5}, None),  # a fraction of an epoch: at the epoch's middle
        ({"max_steps": 6, "val_check_interval": 10, "check_val_every_n_epoch": 1}, None),  # at the epoch's end
    ],
)
def test_never_validates_follows_lightnings_validation_schedule(trainer: dict, refused: str | None) -> None:
    why = never_validates(trainer)
    assert why is None if refused is None else refused in why


@pytest.mark.parametrize(
    ("fid_every", "val_every", "refused"),
    [(10, 1000, None), (20, 5, "set callbacks.fid.every_n_steps=10 or lower")],
)
def test_a_fid_objective_follows_the_fid_callbacks_schedule_not_validation(fid_every, val_every, refused) -> None:
    """val/cfid@K is logged by the FID callback every callbacks.fid.every_n_steps steps, whatever validation does
    (before: refused by trainer.val_check_interval, and a FID interval beyond the run was not caught)."""
    from ddpm.objective import never_logged

    resolved = {"trainer": {"max_steps": 10, "val_check_interval": val_every}, "model": {"num_classes": None},
                "callbacks": {"fid": {"_target_": "ddpm.callbacks.fid.FID", "every_n_steps": fid_every,
                                      "features": "clf.pt", "num_samples": 1000}}}  # fmt: skip
    why = never_logged("val/cfid@1k", resolved)
    assert why is None if refused is None else refused in why and "callbacks.fid" in why
    assert (never_logged("val/loss", resolved) is None) == (val_every <= 10)  # val/loss: validation's schedule


def test_a_sweep_whose_jobs_would_never_validate_is_refused_at_each_jobs_start(tmp_path: Path) -> None:
    """Before: each job trained to the end and recorded val/loss null, status COMPLETED."""
    sweep = tmp_path / "sweep"
    result = train("-m", *TINY_SWEEP, "trainer.val_check_interval=100", "optim.lr=1e-3", f"hydra.sweep.dir={sweep}",
                   check=False)  # fmt: skip
    assert result.returncode == 1
    (row,) = read_summary(sweep)
    assert row["status"] == "FAILED" and "no job of this sweep would validate" in row["error"], row
    assert "set trainer.val_check_interval=6 or lower" in row["error"] and not (sweep / "0" / "checkpoints").exists()


def test_summary_rows_rank_completed_values_then_completed_without_then_failed(tmp_path: Path) -> None:
    """A completed job without a value (tune=lr_find alone) and a failed one both sorted as +inf, ties in path text
    order: a FAILED row could stand above a COMPLETED one, and job 10 before job 2."""
    from ddpm.sweep import collect

    jobs = {"0": ("FAILED", None), "1": ("COMPLETED", None), "2": ("COMPLETED", 0.5), "10": ("COMPLETED", 0.5),
            "3": ("COMPLETED", 0.25)}  # fmt: skip
    for job, (status, value) in jobs.items():
        (tmp_path / job).mkdir()
        record = {"overrides": [f"optim.lr={job}"], "status": status, "val/loss": value}
        (tmp_path / job / "result.json").write_text(json.dumps(record))
    assert [row["job"] for row in collect(tmp_path, "val/loss")] == ["3", "2", "10", "1", "0"]
    assert [row["job"] for row in collect(tmp_path, "val/loss", maximize=True)] == ["2", "10", "3", "1", "0"]


def test_only_the_first_process_of_a_job_writes_its_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process of a DDP job (srun's tasks, Lightning's launches of train.py) ends its own Hydra job: rank 1
    rewrote result.json and summary.csv after rank 0."""
    monkeypatch.setattr("ddpm.sweep.first_process", lambda: False)
    done = JobReturn(status=JobStatus.COMPLETED, _return_value=0.25)
    SweepSummary(objective="val/loss").on_job_end(job_config(tmp_path / "sweep", "0", ["optim.lr=1e-3"]), done)
    assert not (tmp_path / "sweep").exists()
