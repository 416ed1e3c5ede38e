"""`hydra/sweeper: capped_optuna`: hydra-optuna-sweeper's `optuna` sweeper whose study records a failed trial and
goes on, up to `max_failures` (conf/hparams_search/optuna.yaml and mnist_quality.yaml choose it).

Hydra instantiates a sweeper only from the `hydra_plugins` package (hydra/core/plugins.py,
`is_in_toplevel_plugins_module`) and imports every module found there at each start, so this module stays small:
the config schema (the plugin's `OptunaSweeperConf` plus `max_failures`) and a Sweeper that hands the study to
ddpm.optuna_sweeper.CappedStudy, imported (with optuna) only when a study runs.
"""

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
from omegaconf import DictConfig


@dataclass
class CappedOptunaSweeperConf(OptunaSweeperConf):
    _target_: str = "hydra_plugins.ddpm_sweeper.capped_optuna.CappedOptunaSweeper"
    max_failures: int | None = 5  # failed trials (this invocation) that stop the study; None: no cap


ConfigStore.instance().store(group="hydra/sweeper", name="capped_optuna", node=CappedOptunaSweeperConf,
                             provider="lightning-ddpm")  # fmt: skip


class CappedOptunaSweeper(Sweeper):
    """The `optuna` sweeper's keys, plus `max_failures`: failed trials (this invocation) that stop the study."""

    def __init__(
        self,
        *,
        sampler: Any,
        direction: Any,
        storage: Any,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failures: int | None,
        max_failure_rate: float = 0.0,
        search_space: DictConfig | None = None,
        custom_search_space: str | None = None,
        params: DictConfig | None = None,
    ) -> None:
        from ddpm.optuna_sweeper import CappedStudy

        self.study = CappedStudy(sampler=sampler, direction=direction, storage=storage, study_name=study_name,
                                 n_trials=n_trials, n_jobs=n_jobs, max_failures=max_failures,
                                 max_failure_rate=max_failure_rate, search_space=search_space,
                                 custom_search_space=custom_search_space, params=params)  # fmt: skip

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.study.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.study.sweep(arguments)
