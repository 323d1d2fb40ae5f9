#!/usr/bin/env python3
"""Reads an MLflow file store (`mlruns/`) with MLflow's own client, the calls its UI lists
runs with (search_experiments, search_runs, get_metric_history), and prints one JSON object:
{"experiments": [name, ...], "runs": [{"experiment", "name", "status", "params", "tags",
"metrics": {key: [[step, value], ...]}}]}. Needs `pip install mlflow-skinny`.

    python3 tools/read_mlflow.py target/nlp_example/mlruns

MLflow 3 keeps the file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE=true, which
this sets; `mlflow migrate-filestore` moves such a store into a database.
"""
import json
import os
import sys

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

from mlflow.tracking import MlflowClient  # noqa: E402


def main(store: str) -> None:
    client = MlflowClient(tracking_uri="file://" + os.path.abspath(store))
    experiments = client.search_experiments()
    out = {"experiments": sorted(e.name for e in experiments), "runs": []}
    for e in experiments:
        for run in client.search_runs([e.experiment_id]):
            history = {
                key: [
                    [m.step, m.value]
                    for m in sorted(
                        client.get_metric_history(run.info.run_id, key), key=lambda m: m.step
                    )
                ]
                for key in run.data.metrics
            }
            out["runs"].append(
                {
                    "experiment": e.name,
                    "name": run.info.run_name,
                    "status": run.info.status,
                    "params": run.data.params,
                    "tags": dict(run.data.tags),
                    "metrics": history,
                }
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
