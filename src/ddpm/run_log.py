"""`RunLog`: the Hydra callback that sends Lightning's messages and warnings into the run's log file as well
(ddpm.logs says why the file needs it)."""

import logging
import warnings
from typing import Any, TextIO

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddpm.logs import LIGHTNING, LOG

ADVERT = "Tip: For seamless cloud logging"  # Lightning 2.6 recommends its cloud logger in every Trainer's output
RANK_ZERO = "lightning.pytorch.utilities.rank_zero"  # the logger of Lightning's rank_zero_info


def no_advert(record: logging.LogRecord) -> bool:
    """A logging filter: everything but Lightning's advertisement (a line of every run, console and train.log)."""
    return ADVERT not in record.getMessage()


class RunLog(Callback):
    """A Hydra callback (conf/train.yaml, conf/sample.yaml): for the job's length, Lightning's records also reach
    the root logger (its file), and each warning shown on the console is logged as well (logger `py.warnings`);
    Lightning's advertisement for its cloud logger is left out of both."""

    def __init__(self) -> None:
        self.shown: Any = None  # warnings.showwarning before this job
        self.handlers: list[logging.Handler] = []  # the root's (the job's file), lent to Lightning's loggers

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.handlers = list(logging.getLogger().handlers)  # not propagation: `lightning` would print them again
        for name in LIGHTNING:
            for handler in self.handlers:
                logging.getLogger(name).addHandler(handler)
        logging.getLogger(RANK_ZERO).addFilter(no_advert)
        self.shown = warnings.showwarning
        warnings.showwarning = self._show

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        error = job_return._return_value  # the public property re-raises a failed job's error
        if job_return.status == JobStatus.FAILED and isinstance(error, BaseException):
            LOG.error("failed: %s: %s", type(error).__name__, error)  # result.json holds the traceback
        for name in LIGHTNING:
            for handler in self.handlers:
                logging.getLogger(name).removeHandler(handler)
        self.handlers = []
        logging.getLogger(RANK_ZERO).removeFilter(no_advert)
        if self.shown is not None:
            warnings.showwarning, self.shown = self.shown, None

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
        self.shown(message, category, filename, lineno, file, line)
        logging.getLogger("py.warnings").warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)
