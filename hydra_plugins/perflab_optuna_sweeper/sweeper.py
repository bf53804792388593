"""Hydra's Optuna sweeper as this project runs it (hydra/sweeper=optuna; its settings: src/config/schema.py's
OptunaSweeperConfig, the objective and the checks: src/tracking/search.py).

The plugin's sweeper, with two of its raises after the trials have run turned into log lines, since
a sweeper that raises makes Hydra skip the sweep callback's end, which leaves the MLflow parent
RUNNING and writes no sweep.csv, under a traceback below the trials' own errors:
- a study in which no trial finished: the plugin asks it for its best trial and Optuna raises
  "No trials are completed yet"; it ends as a sweep whose jobs all failed;
- a grid (hydra/sweeper/sampler=grid) whose last trial failed: GridSampler stops the study when its
  last point is told, and Study.stop raises outside study.optimize, where the plugin tells trials;
  it catches that for a finished trial, not for a failed one. Every trial has run by then.
This module lives in hydra_plugins because Hydra instantiates sweepers from that package only.
"""
from __future__ import annotations

import logging

log = logging.getLogger("src.sweep")

try:
    from hydra_plugins.hydra_optuna_sweeper import optuna_sweeper as plugin
except ImportError:  # Hydra imports every hydra_plugins module on each run: without the plugin, stay quiet until asked for
    plugin = None


class _Missing:
    def __init__(self, *args, **kwargs) -> None:
        raise ImportError("hydra/sweeper=optuna needs Hydra's Optuna sweeper: pip install 'hydra-optuna-sweeper>=1.2,<1.4'")


class OptunaSweeper(plugin.OptunaSweeper if plugin is not None else _Missing):
    def setup(self, *, hydra_context, task_function, config) -> None:
        # Optuna's own handler colours every line, a terminal or not (ANSI codes in a redirected log):
        # its lines go through Hydra's logging instead, as every other line of the sweep does
        import optuna

        optuna.logging.disable_default_handler()
        optuna.logging.enable_propagation()
        # no hydra.sweeper.direction given: search for the objective's better side, not Optuna's minimize
        if self.sweeper.direction is None:
            from src.tracking.search import better_direction, objective_of

            self.sweeper.direction = better_direction(config)
            log.info("Optuna: %s %s (sweep.objective's better side)", self.sweeper.direction, objective_of(config))
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        try:
            return super().sweep(arguments)
        except ValueError as err:
            if "No trials are completed yet" not in str(err):
                raise
            log.error("Optuna: no trial finished, so the study has no best trial (and no optimization_results.yaml); "
                      "each trial's error is above")
        except RuntimeError as err:
            if "Study.stop" not in str(err):
                raise
            log.warning("Optuna: the grid's last trial failed, and the plugin could not tell the study it was done; every trial "
                        "ran and is recorded (the best: the parent run's best_job), but there is no optimization_results.yaml")
        return None
