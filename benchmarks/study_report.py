"""The table and plots of an Optuna study run by `hparams_search=...` (its sqlite storage): every trial best first,
Optuna's optimization history (<plots>_history.png) and parameter importances (<plots>_importance.png: a seeded random
forest's mean decrease in impurity; optuna 2.10's own plot needs matplotlib's removed cm.get_cmap). --smoke: a toy
study of three trials.

    python benchmarks/study_report.py --storage multirun/optuna/mnist_quality/optuna.db --study mnist_quality
"""

import argparse
import tempfile
from pathlib import Path

import common
import matplotlib

matplotlib.use("Agg")
import optuna
from matplotlib import pyplot as plt
from optuna.visualization import matplotlib as plots


def save_plots(study: optuna.Study, prefix: Path) -> list[Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    importances = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0))  # fmt: skip
    bars, ax = plt.subplots()
    ax.barh(list(importances)[::-1], list(importances.values())[::-1], color="tab:blue")
    ax.set(xlabel="importance (mean decrease in impurity)", title="Parameter importances")
    written = []
    for name, figure in (("history", plots.plot_optimization_history(study).figure), ("importance", bars)):
        figure.set_size_inches(7, 4)
        figure.tight_layout()
        written.append(prefix.with_name(f"{prefix.name}_{name}.png"))
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", type=Path, help="the study's optuna.db (hydra.sweep.dir/optuna.db)")
    p.add_argument("--study", default="mnist_quality", help="hydra.sweeper.study_name")
    p.add_argument("--plots", type=Path, help="path prefix of the two PNG files; none: no plots")
    common.add_arguments(p, repeats=None)
    run = common.start(__file__, p, argv, smoke={"study": "smoke"})
    args = run.args
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp) / "optuna.db" if args.smoke else args.storage
        if args.smoke:  # a quadratic in two parameters, stored as hparams_search stores a study
            toy = optuna.create_study(study_name=args.study, storage=f"sqlite:///{storage}", direction="minimize")
            toy.optimize(lambda t: (t.suggest_float("optim.lr", 1e-4, 1e-2, log=True) - 1e-3) ** 2
                         + t.suggest_categorical("diffusion.prediction", ["eps", "v"]).count("v"),
                         n_trials=3)  # fmt: skip
        if storage is None or not Path(storage).is_file():
            raise SystemExit(f"--storage {storage}: no such optuna.db; pass hydra.sweep.dir/optuna.db of the study")
        study = optuna.load_study(study_name=args.study, storage=f"sqlite:///{storage}")
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
        rows = sorted(({"number": t.number, "value": t.value, **t.params} for t in done), key=lambda r: r["value"])
        params = sorted({k for r in rows for k in r} - {"number", "value"})
        fmt = lambda v: f"{v:.2e}" if isinstance(v, float) and v != 0 and not 1e-2 <= abs(v) < 1e4 else v  # noqa: E731
        cells = [[r["number"], *(fmt(r.get(k)) for k in params), f"{r['value']:.2f}"] for r in rows]
        print(common.table(["trial", *params, "objective"], cells))
        plotted = args.plots or (Path(tmp) / "smoke" if args.smoke else None)
        report = {"study": args.study, "storage": str(storage), "trials": rows, "best": rows[0] if rows else None,
                  "failed": sum(t.state != optuna.trial.TrialState.COMPLETE for t in study.trials),
                  "plots": [str(x) for x in save_plots(study, plotted)] if plotted else []}  # fmt: skip
        print(f"{len(rows)} completed trials; best: {report['best']}")
        run.write(report, f"study_{args.study}.json")
    return report


if __name__ == "__main__":
    main()
