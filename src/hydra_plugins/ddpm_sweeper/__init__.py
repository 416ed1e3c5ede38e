"""lightning-ddpm's Hydra plugins (Hydra finds sweepers only under `hydra_plugins`); see capped_optuna.py."""
