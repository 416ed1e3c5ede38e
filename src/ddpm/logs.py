"""The run's log file: `<run>/train.log` (`sample.log` for sample.py) holds what the run said, with times.

Hydra writes the Python logging of a job into `<run>/<job>.log` (conf/hydra/job_logging/run_log.yaml: the file
only; the console stays as Lightning and this code print it). Lightning's loggers print through their own handler
and do not reach the root logger, and neither `print` nor `warnings` log anything, so without `RunLog` the file
stays empty. `RunLog` (a Hydra callback) sends Lightning's messages and every warning to the file as well, and
`say` prints a line and logs it. Outside Hydra (no handler on the root logger) `say` is `print`. `RunLog` lives
in ddpm.run_log, so that this module imports nothing of Hydra.
"""

import logging

LOG = logging.getLogger("ddpm")
LIGHTNING = ("lightning.pytorch", "lightning.fabric")  # each prints through its own handler, not the root's


def say(message: str) -> None:
    """Print `message` and log it at INFO: into the run's log file under Hydra."""
    print(message)
    LOG.info(message)
