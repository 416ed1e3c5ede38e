"""Train a diffusion model: `python train.py [experiment=...] [key=value ...]` (see README.md)."""

import hydra
from omegaconf import DictConfig

from ddpm.config.overrides import hint_misspelled_overrides
from ddpm.training import train


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    with hint_misspelled_overrides("train"):
        main()
