"""The Optuna study of `hparams_search=optuna`: a failed trial is recorded FAIL and the study goes on, up to a cap.

hydra-optuna-sweeper 1.3.0 (hydra_plugins/hydra_optuna_sweeper/_impl.py, `OptunaSweeperImpl.sweep`) tells Optuna
a failed trial is FAIL, then re-raises its error when the failed share of a batch of `n_jobs` trials is above
`max_failure_rate` (0.0 by default): with n_jobs=1 the first diverging trial ends the study and the later trials
never run. `CappedStudy` keeps the plugin's search space, sampler, storage and trial configuration (its methods)
and replaces that loop:

- a trial fails when its job raised, or returned something that is not a finite number (None when no
  validation ran, NaN); it is told FAIL, logged on one line with its overrides, and the study goes on;
- after `hydra.sweeper.max_failures` failed trials in one invocation (null: no cap) the study stops with
  `TooManyFailedTrials`, naming the key and each failed trial's error; a study with no completed trial at its
  end raises it too (there is no best trial);
- otherwise the end is the plugin's: optimization_results.yaml with the best parameters and value.

Hydra builds sweepers only from the `hydra_plugins` package: `hydra/sweeper: capped_optuna` is
hydra_plugins/ddpm_sweeper/capped_optuna.py, which hands the study to `CappedStudy`.
"""

import functools
import logging
import math
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import Trial, TrialState

from ddpm.sweep import RESULT_FILE, error_line

log = logging.getLogger(__name__)
GRID_STOP = "`Study.stop` is supposed to be invoked inside an objective function or a callback."  # GridSampler's


class TooManyFailedTrials(RuntimeError):
    """The study reached hydra.sweeper.max_failures failed trials, or ended with no completed trial."""


class CappedStudy(OptunaSweeperImpl):
    """OptunaSweeperImpl whose failed trials are recorded and counted instead of ending the study."""

    def __init__(
        self,
        *,
        sampler: Any,  # an optuna sampler (instantiated from hydra.sweeper.sampler; GridSampler: a partial)
        direction: Any,  # minimize / maximize, or a list of them (several objectives)
        storage: Any,  # an Optuna storage URL (sqlite:///...), or None: in memory
        study_name: str | None,  # the study to create or continue
        n_trials: int,  # trials in this invocation
        n_jobs: int,  # trials launched at a time
        max_failures: int | None,  # failed trials (this invocation) that stop the study; None: no cap
        max_failure_rate: float = 0.0,  # the plugin's per-batch rate: refused unless 0.0 (max_failures replaces it)
        search_space: Any = None,  # the plugin's deprecated search-space form
        custom_search_space: str | None = None,  # a function (dotted path) adding parameters to each trial
        params: Any = None,  # {key: sweep expression}: the search space
    ) -> None:
        if max_failures is not None and max_failures < 1:
            raise ValueError(f"hydra.sweeper.max_failures={max_failures} must be >= 1 (null: no cap)")
        if max_failure_rate != 0.0:
            raise ValueError(
                f"hydra.sweeper.max_failure_rate={max_failure_rate}: this sweeper does not read the plugin's per-batch "
                "rate; a failed trial is recorded and the study goes on until hydra.sweeper.max_failures failures"
            )
        # max_failure_rate 1.0: the plugin's own check never fires (the loop below is ours)
        super().__init__(sampler, direction, storage, study_name, n_trials, n_jobs, 1.0, search_space,
                         custom_search_space, params)  # fmt: skip
        self.max_failures = max_failures

    def sweep(self, arguments: list[str]) -> None:
        study, space, fixed = self._open_study(arguments)
        objectives, failed, left = len(self._get_directions()), [], self.n_trials
        while left > 0:
            trials = [study.ask() for _ in range(min(left, self.n_jobs))]
            overrides = self._configure_trials(trials, space, fixed)
            returns = self.launcher.launch(overrides, initial_job_idx=self.job_idx)
            self.job_idx += len(returns)
            for trial, job in zip(trials, returns, strict=True):
                failed += self._tell(study, trial, job, objectives)
            left -= len(trials)
            if self.max_failures is not None and len(failed) >= self.max_failures:
                raise TooManyFailedTrials(stop_message(failed, self.n_trials - left, self.max_failures))
        if not any(t.state == TrialState.COMPLETE for t in study.trials):
            raise TooManyFailedTrials(stop_message(failed, self.n_trials, None))
        if failed:
            log.warning(f"{len(failed)} of {self.n_trials} trials failed (recorded FAIL); summary.csv lists them")
        self._save_results(study)

    def _open_study(self, arguments: list[str]) -> tuple[optuna.Study, dict[str, BaseDistribution], dict[str, Any]]:
        """The search space (hydra.sweeper.params, then the command line) and the study, as the plugin makes them."""
        self._process_searchspace_config()
        given, fixed = create_params_from_overrides([*self._parse_sweeper_params_config(), *arguments])
        space = {**(self.search_space_distributions or {}), **given}
        grid = isinstance(self.sampler, functools.partial) and self.sampler.func == optuna.samplers.GridSampler
        if grid:
            choices = {name: self._to_grid_sampler_choices(distribution) for name, distribution in space.items()}
            self.sampler = self.sampler(choices)
            self.n_trials = min(self.n_trials, math.prod(len(values) for values in choices.values()))
        space = {name: distribution for name, distribution in space.items() if name not in fixed}
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    directions=self._get_directions(), load_if_exists=True)  # fmt: skip
        log.info(f"Study {study.study_name} in {self.storage}, sampler {type(self.sampler).__name__}")
        if study.trials and not grid:  # a continued study: its seeded sampler would draw the first run's trials again
            study.sampler.reseed_rng()
            log.info(f"Continuing after {len(study.trials)} trials: the sampler is reseeded (new draws, not a replay)")
        return study, space, fixed

    @staticmethod
    def _tell(study: optuna.Study, trial: Trial, job: JobReturn, objectives: int) -> list[str]:
        """Record the trial COMPLETE with its values, or FAIL; [its one-line description] if it failed."""
        values, error = trial_values(job, objectives)
        try:
            study.tell(trial, state=TrialState.FAIL if error else TrialState.COMPLETE, values=values)
        except RuntimeError as stop:  # GridSampler stops the study after the grid's last point (the plugin's case)
            if GRID_STOP not in str(stop):
                raise
        if error is None:
            return []
        folder = OmegaConf.select(job.hydra_cfg, "hydra.runtime.output_dir") if job.hydra_cfg else None
        searched = " ".join(f"{key}={value}" for key, value in trial.params.items()) or " ".join(job.overrides or [])
        line = f"trial {trial.number} ({searched}): {error}"
        log.warning(f"Failed trial, recorded FAIL; the study goes on. {line} (traceback: {folder}/{RESULT_FILE})")
        return [line]

    def _save_results(self, study: optuna.Study) -> None:
        """optimization_results.yaml in the sweep folder: the best trial (one objective) or the Pareto front."""
        if len(self._get_directions()) == 1:
            best = study.best_trial
            results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            log.info(f"Best parameters: {best.params}; best value: {best.value}")
        else:
            front = [{"params": t.params, "values": t.values} for t in study.best_trials]
            results = {"name": "optuna", "solutions": front}
            log.info(f"Number of Pareto solutions: {len(front)}")
        OmegaConf.save(OmegaConf.create(results), f"{self.config.hydra.sweep.dir}/optimization_results.yaml")


def trial_values(job: JobReturn, objectives: int) -> tuple[list[float] | None, str | None]:
    """(the values to tell Optuna, None) for a job that returned `objectives` finite numbers, else (None, why)."""
    value = job._return_value  # the public property re-raises a failed job's error
    if job.status != JobStatus.COMPLETED:
        return None, error_line(value) if isinstance(value, BaseException) else f"the job ended {job.status.name}"
    items = [value] if objectives == 1 else value
    try:
        values = [float(v) for v in items]
    except (TypeError, ValueError):
        values = []
    if len(values) == objectives and all(math.isfinite(v) for v in values):
        return values, None
    if value is None:
        return None, (
            "the job returned no objective value (None): no validation ran before the end (trainer.val_check_interval "
            "above trainer.max_steps, trainer.limit_val_batches=0), or tune=lr_find ran without tune.apply=true"
        )
    return None, f"the job returned {value!r}, not {objectives} finite number(s) (the objective: val/loss, ...)"


def stop_message(failed: list[str], ran: int, cap: int | None) -> str:
    """Why the study stopped, the failed trials' errors, and what to change."""
    cause = (
        f"hydra.sweeper.max_failures={cap} reached: {len(failed)} of the {ran} trials run failed, so the study stops"
        if cap is not None
        else f"no trial of the study completed ({len(failed)} of the {ran} trials of this invocation failed)"
    )
    listed = "\n".join(f"  {line}" for line in failed)
    more = ", or raise hydra.sweeper.max_failures (null: no cap) to let the study go on past failures" if cap else ""
    return (
        f"{cause}. Each is recorded FAIL in the study, its error in summary.csv and its job's {RESULT_FILE}:\n"
        f"{listed}\nFix the cause above{more}"
    )
