"""A quantization sweep of the edge path in MLflow (issue 57): `python -m src.run -m +exp=edge
edge.quant=... edge.batch=...` on Mesa's lavapipe is one parent run with a child per job, each
child's format and batch its params and its figures metrics the runs table compares."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("iree.turbine")

from mlflow.tracking import MlflowClient  # noqa: E402

from src.edge.bench import tolerance  # noqa: E402
from src.tracking.ui_view import VIEW_TAG, read_state  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.lavapipe import needs_vulkan  # noqa: E402

QUANTS, BATCHES = ("none", "int8"), (1, 4)
# what a job compares on: speed, the logits' error against torch fp32, the greedy tokens' agreement, sizes
FIGURES = ("decode_tokens_per_s", "decode_p50_ms", "decode_p90_ms", "ttft_p50_ms", "prefill_tokens_per_s", "rel_err", "rel_err_prefill",
           "token_agreement", "params_bytes", "module_bytes")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge_sweep_cache")


@needs_vulkan
def test_a_quant_by_batch_sweep_is_one_parent_with_a_child_per_job_and_its_figures(tmp_path, cache):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # 4 decode steps after an 8-token prompt, 2 timed repeats: each job is an export and a compile
    # (10 and 6-12 s on 2 cores) and a few seconds of lavapipe
    proc = run_cli(["-m", "+exp=edge", f"edge.quant={','.join(QUANTS)}", f"edge.batch={','.join(map(str, BATCHES))}", f"edge.cache_dir={cache}",
                    "edge.prompt_len=8", "edge.decode_steps=4", "edge.repeats=2", "edge.warmup=1", f"tracking.uri={store}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 1 + len(QUANTS) * len(BATCHES) and len(children) == len(QUANTS) * len(BATCHES)
    # the parent names the sweep and holds the values each swept key took
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep"] == "true"
    assert parent.info.run_name.startswith("sweep ") and "edge.quant=none,int8" in parent.info.run_name and "edge.batch=1,4" in parent.info.run_name
    assert parent.data.params == {"edge.quant": "none,int8", "edge.batch": "1,4"}
    assert parent.data.tags["jobs"] == "4 finished, 0 failed"

    assert all(c.info.status == "FINISHED" for c in children)
    by_job = {(c.data.params["edge.quant"], int(c.data.params["edge.batch"])): c for c in children}
    assert sorted(by_job) == sorted((q, b) for q in QUANTS for b in BATCHES)
    for (quant, batch), child in by_job.items():
        metrics = {k.removeprefix("summary."): v for k, v in child.data.metrics.items()}
        assert all(math.isfinite(metrics[f]) and metrics[f] >= 0 for f in FIGURES), {f: metrics.get(f) for f in FIGURES}
        assert metrics["decode_p50_ms"] > 0 and metrics["params_bytes"] > 0 and metrics["module_bytes"] > 0
        assert metrics["decode_tokens_per_s"] == pytest.approx(batch * 1000 / metrics["decode_p50_ms"])
        assert metrics["rel_err"] <= tolerance("fp32", quant) and 0 < metrics["token_agreement"] <= 1
        assert child.data.params["edge.dtype"] == "fp32" and child.data.params["model.name"] == "tiny"
        if quant != "none":  # the device's own arithmetic against the quantized torch model, apart
            assert math.isfinite(metrics["rel_err_vs_quantized"])
    for quant in QUANTS:
        one, four = (by_job[quant, b].data.metrics["summary.decode_tokens_per_s"] for b in BATCHES)
        assert one != four, (quant, one, four)
    # int8 stores the block weights in a quarter of fp32's bytes: its archive is the smaller
    assert by_job["int8", 1].data.metrics["summary.params_bytes"] < by_job["none", 1].data.metrics["summary.params_bytes"]

    # the view the sweep's last line opens: the children, with the figures and the swept keys as columns
    experiment = client.get_experiment(parent.info.experiment_id)
    state = read_state(experiment.tags[f"{VIEW_TAG}perflab-sweep-{parent.info.run_id[:12]}"])
    assert state["searchFilter"] == f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    for column in ("metrics.`summary.decode_tokens_per_s`", "metrics.`summary.rel_err`", "metrics.`summary.token_agreement`",
                   "metrics.`summary.params_bytes`", "params.`edge.quant`", "params.`edge.batch`"):
        assert column in state["selectedColumns"], state["selectedColumns"]
