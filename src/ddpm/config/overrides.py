"""A misspelled override named with the key it was meant to be. Hydra refuses `optim.lrr=1e-3` with "To append to
your config use +optim.lrr=1e-3", advice that moves the typo into the config, where validate.py refuses it as a key
nothing reads; `hint_misspelled_overrides` adds the key meant to the first refusal."""

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from ddpm.config import CONF
from ddpm.config.validate import similarity, suggest


def misspelled(config_name: str, overrides: Sequence[str], conf: Path = CONF) -> dict[str, str]:
    """{key: the known key closest to it} for each override that names no key of `config_name` composed with the
    other overrides (a sweep's first value stands for the sweep); {} where nothing else stops the composition."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    kept, bad = _first_values(overrides), []
    GlobalHydra.instance().clear()  # hydra.main's, after a failed start
    with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
        while True:
            try:
                cfg = compose(config_name, overrides=kept, return_hydra_config=True)
                break
            except HydraException as error:
                key = getattr(error.__cause__, "full_key", None)  # trainr.max_steps: Hydra names `trainr`
                named = [line for line in kept if _key(line) == key or _key(line).startswith(f"{key}.")]
                if not key or not named:
                    return {}  # another problem (a group option that does not exist ...): Hydra's message says it
                bad += [_key(line) for line in named]
                kept = [line for line in kept if line not in named]
    container = OmegaConf.to_container(cfg, resolve=False)
    hydra = container.pop("hydra")
    groups = [group for group in hydra["runtime"]["choices"] if "/" not in group]  # experiment, hparams_search
    known, unlisted = _keys(container) + groups, _unlisted_arguments(container)
    hydra = [f"hydra.{key}" for key in _keys(hydra)]  # offered for hydra.* typos only
    return {key: _argument_hint(key, container) or _closer_argument(key, known, unlisted)
            or suggest(key, hydra if key.startswith("hydra.") else known) for key in bad}  # fmt: skip


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _unlisted_arguments(node: dict, prefix: str = "") -> list[str]:
    """`path.arg` for each constructor argument a `_target_` node leaves out (trainer.limit_train_batches): a
    typo of one was matched to the closest listed key, another setting (trainer.limit_val_batches)."""
    from ddpm.config.schema import target_schema

    found = []
    if isinstance(target := node.get("_target_"), str):
        try:
            found = [f"{prefix}{arg}" for arg in target_schema(target).hints if arg not in node]
        except Exception:  # a target that cannot be imported: the validator names it
            found = []
    children = ((key, value) for key, value in node.items() if isinstance(value, dict))
    return found + [arg for key, value in children for arg in _unlisted_arguments(value, f"{prefix}{key}.")]


def _closer_argument(key: str, known: list[str], unlisted: list[str], margin: float = 0.2) -> str | None:
    """The hint for an unlisted argument of the key's node clearly closer to it than any listed key (by `margin`:
    limit_train_batchs is limit_train_batches, not the listed limit_val_batches; every_n_step stays the listed
    every_n_train_steps, not every_n_epochs); None: suggest among the listed keys."""
    section, _, leaf = key.rpartition(".")
    score = lambda k: similarity(leaf, k.rpartition(".")[2])  # noqa: E731
    arguments = [k for k in unlisted if k.rpartition(".")[0] == section]
    if not arguments:
        return None
    best = max(arguments, key=score)
    listed = max((score(k) for k in known if k.rpartition(".")[0] == section), default=0.0)
    if score(best) >= 0.8 and score(best) > listed + margin:
        return f"did you mean {best}? (an argument this config does not list: +{best}=...)"
    return None


def _argument_hint(key: str, config: dict) -> str | None:
    """For an argument of its node's `_target_` that the config leaves out (callbacks.sample_grid.seed,
    trainer.max_time), how to set it: the closest listed key would be another setting (the run's `seed`)."""
    from ddpm.config.schema import target_schema

    *parents, leaf = key.split(".")
    node: object = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    target = node.get("_target_") if isinstance(node, dict) else None
    if not isinstance(target, str) or leaf not in target_schema(target).hints:
        return None
    return f"an argument of {target} that this config does not list; set it with +{key}=..."


@contextmanager
def hint_misspelled_overrides(config_name: str, argv: Sequence[str] | None = None) -> Iterator[None]:
    """Run an entry point (`hydra.main`'s function); if it fails, name the key meant by each misspelled override
    of `argv` (default: sys.argv) on stderr after Hydra's message."""
    try:
        yield
    except (SystemExit, Exception) as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            _explain(config_name, list(sys.argv[1:] if argv is None else argv))
        raise


def _explain(config_name: str, argv: list[str]) -> None:
    if any(arg in ("-cn", "-cp", "-cd") or arg.startswith("--config") for arg in argv):
        return  # another config than the one named here
    try:
        found = misspelled(config_name, [arg for arg in argv if "=" in arg and not arg.startswith("-")])
    except Exception:  # the hint is a courtesy: the run's own error stands
        return
    for key, hint in found.items():
        unread = "" if hint.startswith("an argument of") else f" (`+{key}=` would add a key that nothing reads)"
        print(f"{key}: no such key; {hint}{unread}", file=sys.stderr)


def _first_values(overrides: Sequence[str]) -> list[str]:
    """The overrides with each sweep (a,b / range(...)) replaced by its first value, intervals left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    kept = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if not override.is_sweep_override():
            kept.append(override.input_line)
        elif not override.is_interval_sweep():
            kept.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
    return kept


def _keys(node: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a config as plain data."""
    nested = lambda key, value: _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else []  # noqa: E731
    return [k for key, value in node.items() for k in (f"{prefix}{key}", *nested(key, value))]
