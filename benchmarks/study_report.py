"""The table and plots of an Optuna study run by `hparams_search=...` (its sqlite storage), for the docs.

    python train.py experiment=mnist hparams_search=mnist_quality callbacks.fid.features=mnist_classifier.pt
    python benchmarks/study_report.py --storage multirun/optuna/mnist_quality/optuna.db --study mnist_quality \
        --plots docs/mnist_study

Prints every trial best first (its parameters and objective) as Markdown, and writes with matplotlib Optuna's
optimization history (`<plots>_history.png`) and parameter importances (`<plots>_importance.png`, a seeded random
forest's mean decrease in impurity). The JSON (--out) holds the trials with benchmarks/common.py's provenance.
--smoke: a study of three trials of a toy objective, made in a temp folder.
"""

import argparse
import math
import tempfile
from pathlib import Path

import common
import matplotlib

matplotlib.use("Agg")
import optuna
from matplotlib import pyplot as plt
from optuna.visualization import matplotlib as plots

SMOKE = {"study": "smoke"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", type=Path, help="the study's optuna.db (hydra.sweep.dir/optuna.db)")
    p.add_argument("--study", default="mnist_quality", help="hydra.sweeper.study_name")
    p.add_argument("--plots", type=Path, help="path prefix of the two PNG files; none: no plots")
    common.add_arguments(p, repeats=None)
    return p


def toy_study(folder: Path, name: str) -> Path:
    """Three trials of a quadratic in two parameters, stored as hparams_search stores them (--smoke)."""
    path = folder / "optuna.db"
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{path}", direction="minimize")
    study.optimize(lambda t: (t.suggest_float("optim.lr", 1e-4, 1e-2, log=True) - 1e-3) ** 2
                   + t.suggest_categorical("diffusion.prediction", ["eps", "v"]).count("v"), n_trials=3)  # fmt: skip
    return path


def trials(study: optuna.Study) -> list[dict]:
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    return sorted(({"number": t.number, "value": t.value, **t.params} for t in done), key=lambda r: r["value"])


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4) else f"{value:g}"
    return "-" if value is None else str(value)


def save_plots(study: optuna.Study, prefix: Path) -> list[Path]:
    """Optuna's optimization history plot, and the parameter importances drawn here from Optuna's evaluator (optuna
    2.10's own importance plot calls matplotlib's removed cm.get_cmap; its fANOVA fails on numpy 2, so the mean
    decrease in impurity of a random forest, seeded)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    history = plots.plot_optimization_history(study).figure
    evaluator = optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0)
    importances = optuna.importance.get_param_importances(study, evaluator=evaluator)
    bars, ax = plt.subplots()
    names = list(importances)[::-1]
    ax.barh(names, [importances[n] for n in names], color="tab:blue")
    ax.set(xlabel="importance (mean decrease in impurity)", title="Parameter importances")
    written = []
    for name, figure in (("history", history), ("importance", bars)):
        figure.set_size_inches(7, 4)
        figure.tight_layout()
        path = prefix.with_name(f"{prefix.name}_{name}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> dict:
    run = common.start(__file__, parser(), argv, smoke=SMOKE)
    args = run.args
    with tempfile.TemporaryDirectory() as tmp:
        storage = toy_study(Path(tmp), args.study) if args.smoke else args.storage
        if storage is None or not Path(storage).is_file():
            raise SystemExit(f"--storage {storage}: no such optuna.db; pass hydra.sweep.dir/optuna.db of the study")
        study = optuna.load_study(study_name=args.study, storage=f"sqlite:///{storage}")
        rows = trials(study)
        params = sorted({k for r in rows for k in r} - {"number", "value"})
        print(
            common.table(
                ["trial", *params, "objective"],
                [[r["number"], *(fmt(r.get(p)) for p in params), f"{r['value']:.2f}"] for r in rows],
            )
        )
        written = (
            save_plots(study, Path(tmp) / "smoke" if args.smoke else args.plots) if args.plots or args.smoke else []
        )
        best = rows[0] if rows else None
        report = {"study": args.study, "storage": str(storage), "trials": rows, "best": best,
                  "failed": sum(t.state != optuna.trial.TrialState.COMPLETE for t in study.trials),
                  "plots": [str(p) for p in written]}  # fmt: skip
        print(f"{len(rows)} completed trials; best: {best and math.isfinite(best['value']) and best}")
        run.write(report, f"study_{args.study}.json")
    return report


if __name__ == "__main__":
    main()
