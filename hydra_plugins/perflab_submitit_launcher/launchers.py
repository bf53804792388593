"""Hydra's submitit launchers as this project runs them (hydra/launcher=submitit_local, submitit_slurm).

The plugin's launchers with one change: each job's result is taken on its own. A job whose process
died without a result (killed by the scheduler at its time limit, out of memory, a SIGKILL) is
recorded FAILED, in its summary.json and its MLflow run, and the sweep goes on; the plugin's own
`launch` raised at the first such job, which ended the sweep with the parent run left RUNNING and
the other jobs unrecorded. How a job runs on its nodes: src/distributed/cluster.py. Their
settings: src/config/schema.py (SubmititLocalConfig, SubmititSlurmConfig). This module lives in
hydra_plugins because Hydra instantiates launchers from that package only.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

log = logging.getLogger("src.cluster")


class _RecordsDeadJobs:
    """Mixin for the plugin's launchers: its `launch`, with each job's result taken on its own."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        # The plugin's BaseSubmititLauncher.launch (hydra-submitit-launcher 1.2), but for the
        # last line, which took every job's result in one list and raised at the first dead job.
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from omegaconf import OmegaConf

        assert self.config is not None and len(job_overrides) > 0
        params = self.params
        init_params: dict[str, Any] = {"folder": params["submitit_folder"]}
        specific_init_keys = {"max_num_timeout"}
        init_params.update(**{f"{self._EXECUTOR}_{k}": v for k, v in params.items() if k in specific_init_keys})
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params)
        base = set(OmegaConf.structured(plugin.BaseQueueConf).keys())
        executor.update_parameters(**{
            k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items() if k not in specific_init_keys | {"submitit_folder"}
        })
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info("submitit '%s': %d job(s) into %s", self._EXECUTOR, len(job_overrides), sweep_dir)
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*job_params))
        return [self._result(job, params[0], params[2]) for job, params in zip(jobs, job_params)]

    def _result(self, job, overrides: list[str], idx: int):
        from hydra.core.utils import JobReturn, JobStatus

        try:
            return job.results()[0]
        except Exception as err:  # the job's process died without a result
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            message = f"job {idx} died without a result ({first[:300]}); its output: {job.paths.stderr}"
            log.error("%s", message)
            self._record_dead_job(overrides, idx, message)
            return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value={"status": "failed", "error": message})

    def _record_dead_job(self, overrides: list[str], idx: int, message: str) -> None:
        """summary.json and the MLflow run FAILED, as src/tasks.py's task_wrapper does for a job that could say why."""
        from omegaconf import OmegaConf, open_dict

        from src.run import job_context
        from src.tasks import record_job_failure

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.num = idx
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        hydra_dir = run_dir / ".hydra"
        if not (hydra_dir / "overrides.yaml").exists():  # the job died before Hydra wrote it: the sweep table names jobs from it
            hydra_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
        ctx = job_context(cfg.hydra, cfg.tracking.uri, str(run_dir), list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        try:
            record_job_failure(cfg, ctx, message)
        except Exception as err:  # never let the record of one job end the sweep
            log.warning("could not record job %d's failure: %s", idx, err)


class LocalLauncher(_RecordsDeadJobs, plugin.LocalLauncher):
    """hydra/launcher=submitit_local: submitit's local executor, jobs as processes on this machine."""


class SlurmLauncher(_RecordsDeadJobs, plugin.SlurmLauncher):
    """hydra/launcher=submitit_slurm: an sbatch array, a job per sweep job, a task per node."""
