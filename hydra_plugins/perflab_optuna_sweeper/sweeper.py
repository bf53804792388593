"""Hydra's Optuna sweeper as this project runs it (hydra/sweeper=optuna; its settings: src/config.py's
OptunaSweeperConfig, the objective and the checks: src/tracking/search.py).

The plugin's sweeper with one change: a study in which no trial finished ends as a sweep whose jobs
all failed. The plugin asks the study for its best trial after the last one, and Optuna raises
"No trials are completed yet"; Hydra then skipped the sweep callback's end, which left the MLflow
parent RUNNING, wrote no sweep.csv, and printed a traceback below the trials' own errors. This module
lives in hydra_plugins because Hydra instantiates sweepers from that package only.
"""
from __future__ import annotations

import logging

from hydra_plugins.hydra_optuna_sweeper import optuna_sweeper as plugin

log = logging.getLogger("src.sweep")


class OptunaSweeper(plugin.OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        try:
            return super().sweep(arguments)
        except ValueError as err:
            if "No trials are completed yet" not in str(err):
                raise
            log.error("Optuna: no trial finished, so the study has no best trial (and no optimization_results.yaml); "
                      "each trial's error is above")
            return None
