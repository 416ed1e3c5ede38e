"""Sample from a trained model: `python sample.py ckpt=PATH [sampler=ddpm sampler.steps=100 guidance=3 ...]`."""

import sys

import hydra
from omegaconf import DictConfig

from ddpm.config.overrides import hint_misspelled_overrides
from ddpm.run_dir import follow_output_dir
from ddpm.sampling import sample


@hydra.main(config_path="conf", config_name="sample", version_base="1.3")
def main(cfg: DictConfig) -> None:
    sample(cfg)


if __name__ == "__main__":
    sys.argv = follow_output_dir(sys.argv)  # output_dir=X is Hydra's run folder too
    with hint_misspelled_overrides("sample"):
        main()
