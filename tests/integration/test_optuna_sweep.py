"""hydra/sweeper=optuna: trials as MLflow children of one parent that names the best, the objective
each trial returns, a failed trial recorded as failed while the study goes on, and a search space
checked before any trial starts."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from src.compare import main as compare_main
from src.config.compose import ConfigError
from src.run import preflight
from tests.support.cli import run_cli

FAST = ["dist.nproc=1", "train.steps=2", "tracking.system_metrics=false"]  # one in-process rank per trial
# TPE's first 10 trials are random draws (n_startup_trials): seeded, the same three every time
# no direction given: the sweeper takes final_loss's better side, minimize
SEARCH = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0",
          "sweep.objective=final_loss", "optim.lr=interval(1e-4,1e-2)"]


def test_an_optuna_sweep_is_one_parent_with_a_child_per_trial_and_names_the_best(workdir: Path, capsys, monkeypatch, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli(["-m", *SEARCH, *FAST], cwd=workdir, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and len(runs) == 4
    assert all(c.info.status == "FINISHED" for c in children)
    # each trial named by what it varies, the value Optuna drew to 4 digits, inside the interval
    lrs = {c.info.run_id: float(c.data.params["optim.lr"]) for c in children}
    assert all(1e-4 <= v <= 1e-2 for v in lrs.values())
    assert all(c.info.run_name == f"optim.lr={lrs[c.info.run_id]:.4g}" for c in children), [c.info.run_name for c in children]
    assert len({c.data.tags["config_hash"] for c in children}) == 3  # what sweep.resume finds them by
    # the objective: what each trial returned to Optuna, its final_loss; the lowest is the best
    losses = {c.info.run_id: c.data.metrics["summary.final_loss"] for c in children}
    best_id = min(losses, key=losses.get)
    assert parent.data.tags["best_run_id"] == best_id
    assert parent.data.tags["best_job"].startswith(f"optim.lr={lrs[best_id]:.4g} (final_loss ")
    assert parent.data.tags["objective"] == "final_loss (lower is better)"
    assert parent.data.metrics["summary.final_loss"] == losses[best_id]
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "3 finished, 0 failed"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep.csv", "sweep.png", "optimization_results.yaml"}
    (results,) = workdir.glob("multirun/*/*/optimization_results.yaml")
    study = yaml.safe_load(results.read_text())
    assert math.isclose(study["best_value"], losses[best_id], rel_tol=1e-6) and study["best_params"]["optim.lr"] == lrs[best_id]
    for n in range(3):
        assert f"#{n} : optim.lr=" in proc.stdout + proc.stderr
    assert "objective final_loss = " in proc.stdout + proc.stderr
    assert "Optuna: minimize final_loss (sweep.objective's better side)" in proc.stdout + proc.stderr
    assert "\x1b[" not in proc.stdout + proc.stderr  # no colour codes in a log that is not a terminal
    # src.compare ranks the sweep by its objective, and stars the job Optuna and the parent name
    monkeypatch.chdir(workdir)
    assert compare_main(["--sweep", "latest", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "3 train runs by final_loss (lower is better, sweep objective)" in out
    (starred,) = [line for line in out.splitlines() if "★" in line]
    assert [c.info.run_name for c in children if c.info.run_id == best_id][0] in starred


def test_a_failed_trial_is_a_failed_optuna_trial_and_the_study_goes_on(workdir: Path):
    """Both trials at once in joblib's workers (a seeded random draw of the two choices: raise, then
    none); the one that raises returns its error, which Optuna records as a failed trial, not a crash."""
    proc = run_cli(["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0", "hydra.sweeper.n_trials=2",
                    "hydra.sweeper.direction=minimize", "sweep.objective=final_loss",
                    "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "fault.kind=choice(none,raise)", "fault.step=1", "tracking=none", *FAST],
                   cwd=workdir, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the sweep ran to its end, and says a job failed
    assert "Failed experiment: Return value must be float-castable. Got 'job failed: InjectedFault: injected fault at step 1'" in out, out
    assert "(fault.kind=raise) failed: InjectedFault" in out
    (results,) = workdir.glob("multirun/*/*/optimization_results.yaml")
    assert yaml.safe_load(results.read_text())["best_params"] == {"fault.kind": "none"}
    assert "setup plugin" not in out  # alembic's notes, from Optuna's import, kept off the console


@pytest.mark.parametrize("overrides, message", [
    # a typo in the search space's key, named as written
    (["optim.lrr=interval(1e-4,1e-2)"], "optim.lrr=interval(1e-4,1e-2): unknown key 'optim.lrr'; valid keys in optim: lr, "),
    (["precision=choice(fp32,fp9)"], "precision=fp9: no such option in group 'precision'; use one of: bf16, fp32, fp8"),
    (["train.steps=interval(2,4)"], "train.steps=interval(2,4): Value '2.0' of type 'float' could not be converted to Integer"),
    (["sweep.objective=final_los", "optim.lr=interval(1e-4,1e-2)"], "sweep.objective=final_los: not a figure task=train reports; use one of: "),
    # Optuna's default direction (minimize) would look for the slowest run
    (["hydra.sweeper.direction=minimize", "optim.lr=interval(1e-4,1e-2)"],
     "hydra.sweeper.direction=minimize would search for the worst tokens_per_s_per_device, where higher is better; pass hydra.sweeper.direction=maximize"),
    (["hydra.sweeper.params.optim.lr='interval(1e-4,1e-2)'"], "give a search space entry on the command line as the key itself, optim.lr=interval(1e-4,1e-2)"),
    (["hydra.sweeper.storage=sqlite:///optuna.db", "optim.lr=interval(1e-4,1e-2)"], "hydra.sweeper.storage=sqlite:///optuna.db: Optuna 2."),
    # what Optuna would draw wrongly, or not at all
    (["optim.lr=interval(1e-2,1e-4)"], "optim.lr=interval(1e-2,1e-4): the low bound 0.01 is above the high bound 0.0001; write optim.lr=interval(0.0001,0.01)"),
    (["optim.lr=tag(lgo,interval(1e-4,1e-2))"], "optim.lr=tag(lgo,interval(1e-4,1e-2)): Optuna does not read the tag lgo and would ignore it; "
                                                 "it reads tag(log,interval(LOW,HIGH)) for a log scale"),
    (["optim.lr=tag(log,interval(0,1e-2))"], "optim.lr=tag(log,interval(0,1e-2)): a log scale needs a low bound above 0 (it is 0.0); e.g. optim.lr=tag(log,interval(1e-05,0.01))"),
    (["train.steps=range(5,2)"], "train.steps=range(5,2): the range holds no value: range(start,stop,step) runs from its start by its step "
                                 "to before its stop, e.g. train.steps=range(2,5)"),
    (["optim.lr=1e-3"], "hydra/sweeper=optuna has nothing to search: it would run the same job 20 times"),
    (["precision=choice(fp32)", "hydra.sweeper.params.x=1"], "give a search space entry on the command line as the key itself"),
    (["precision=choice(fp32)"], "hydra/sweeper=optuna has nothing to search"),
])
def test_a_search_it_cannot_run_is_refused_before_any_trial(overrides: list[str], message: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        preflight(["hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", *overrides], multirun=True)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_preflight_composes_the_corners_of_the_search_space(tmp_path: Path, monkeypatch):
    from src.run import _job_overrides

    monkeypatch.chdir(tmp_path)
    overrides = ["hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "precision=choice(fp32,bf16)", "optim.lr=tag(log,interval(1e-5,1e-2))", "train.steps=3"]
    assert _job_overrides(overrides, multirun=True) == [
        ["train.steps=3", "precision=fp32", "optim.lr=1e-05"], ["train.steps=3", "precision=fp32", "optim.lr=0.01"],
        ["train.steps=3", "precision=bf16", "optim.lr=1e-05"], ["train.steps=3", "precision=bf16", "optim.lr=0.01"],
    ]
    # Hydra's basic sweeper lists values; a range to search is refused with the sweeper that searches it
    with pytest.raises(ConfigError, match=r"optim.lr=interval\(1e-4,1e-2\): Hydra's basic sweeper runs lists of values.*hydra/sweeper=optuna"):
        preflight(["optim.lr=interval(1e-4,1e-2)"], multirun=True)


def test_the_cli_refuses_a_search_space_typo_in_one_line_and_leaves_nothing(workdir: Path):
    proc = run_cli(["-m", *SEARCH[:-1], "optim.lrr=interval(1e-4,1e-2)", *FAST], cwd=workdir, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: optim.lrr=interval(1e-4,1e-2): unknown key 'optim.lrr'") and len(proc.stderr.strip().splitlines()) == 1
    assert list(workdir.iterdir()) == []  # no sweep folder, no MLflow store, no parent run


def test_a_study_whose_trials_all_failed_ends_as_a_sweep_of_failed_jobs(tmp_path: Path, caplog):
    """Optuna has no best trial to give then; the plugin's sweeper raised, and Hydra skipped the
    sweep callback's end (the parent left RUNNING, no table). Ours returns, and says why."""
    import logging

    import optuna
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.perflab_optuna_sweeper.sweeper import OptunaSweeper

    class FailingLauncher:
        def launch(self, job_overrides, initial_job_idx):
            return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value="job failed: InjectedFault: boom") for o in job_overrides]

    sweeper = OptunaSweeper(sampler=optuna.samplers.RandomSampler(seed=0), direction="minimize", storage=None, study_name=None, n_trials=2,
                            n_jobs=1, max_failure_rate=0.0, search_space=None, custom_search_space=None, params=None)
    impl = sweeper.sweeper
    impl.config, impl.launcher, impl.hydra_context = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}), FailingLauncher(), object()
    with caplog.at_level(logging.ERROR, logger="src.sweep"):
        assert sweeper.sweep(["optim.lr=interval(1e-4,1e-2)"]) is None
    assert "Optuna: no trial finished, so the study has no best trial" in caplog.text
    assert not (tmp_path / "optimization_results.yaml").exists()


def test_a_grid_whose_last_trial_failed_ends_without_a_traceback(tmp_path: Path, caplog):
    """GridSampler stops the study at its last point; told as a failed trial, that raised out of the
    plugin's sweep (Study.stop outside study.optimize), once the trials had all run."""
    import functools
    import logging

    import optuna
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.perflab_optuna_sweeper.sweeper import OptunaSweeper

    class Launcher:  # the first trial finishes, the last one fails
        def launch(self, job_overrides, initial_job_idx):
            values = [5.5, "job failed: InjectedFault: boom"]
            return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value=v) for o, v in zip(job_overrides, values)]

    sweeper = OptunaSweeper(sampler=functools.partial(optuna.samplers.GridSampler), direction="minimize", storage=None, study_name=None,
                            n_trials=2, n_jobs=2, max_failure_rate=0.0, search_space=None, custom_search_space=None, params=None)
    impl = sweeper.sweeper
    impl.config, impl.launcher, impl.hydra_context = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}), Launcher(), object()
    with caplog.at_level(logging.WARNING, logger="src.sweep"):
        assert sweeper.sweep(["fault.kind=choice(none,raise)"]) is None
    assert "Optuna: the grid's last trial failed" in caplog.text


@pytest.mark.parametrize("overrides, direction", [
    ([], "maximize"),  # tokens_per_s_per_device, the train task's headline
    (["sweep.objective=final_loss"], "minimize"),
    (["hydra.sweeper.direction=minimize", "sweep.objective=final_loss"], "minimize"),  # given: kept
])
def test_an_optuna_sweep_without_a_direction_searches_for_the_objectives_better_side(overrides: list[str], direction: str, tmp_path: Path,
                                                                                        monkeypatch):
    from hydra.utils import instantiate

    from src.config.compose import compose_config

    monkeypatch.chdir(tmp_path)
    preflight(["hydra/sweeper=optuna", "optim.lr=interval(1e-4,1e-2)", *overrides], multirun=True)  # not refused
    cfg = compose_config(["hydra/sweeper=optuna", *overrides], with_hydra=True)
    sweeper = instantiate(cfg.hydra.sweeper)
    monkeypatch.setattr(sweeper.sweeper, "setup", lambda **kwargs: None)  # the plugin's own setup needs a Hydra run
    sweeper.setup(hydra_context=None, task_function=None, config=cfg)
    assert sweeper.sweeper.direction == direction


def test_hydra_sweeper_optuna_is_ours():
    from src.config.compose import compose_config

    cfg = compose_config(["hydra/sweeper=optuna"], with_hydra=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.perflab_optuna_sweeper.sweeper.OptunaSweeper"
    assert cfg.hydra.sweeper.sampler._target_ == "optuna.samplers.TPESampler"  # the plugin's defaults, kept
