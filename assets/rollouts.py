"""``rollout_batches``: every sample of the latest RL training run, one parquet row each.

``build_rollouts_asset`` makes the same table for any recipe on the RL core (``rlhf_rollout_batches``).

The RL recipe writes one row per sample to ``<log_dir>/rollouts.jsonl``; the training core commits them
with the checkpoint that covers their step and drops rows of steps a resumed run redoes, so the file
holds each step exactly once. This asset reads the file of the latest ``rl_checkpoint``
materialization (its ``log_dir`` metadata) and adds where each row came from: the training run and
the ``tinker://`` sampler weights that produced it (sample from them to reproduce or inspect a
completion). Metadata: reward mean/std per step, a readable sample of groups, and a reward/accuracy
curve (PNG, inline and as an artifact of the training MLflow run).
"""

import statistics
from urllib.parse import urlencode
from collections import defaultdict
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa

from assets.checkpoint_manifest import read_manifest
from assets.outputs import versioned_output
from assets.rl import ROLLOUTS_FILE
from assets.training import TRAINING_GROUP
from assets.upstream import latest_version
from posttrain.training.rows import JsonlRowSink
from resources.mlflow import MlflowResource
from resources.mlflow_links import mlflow_link
from resources.state import state_subdir

TRAINING_ASSET = "rl_checkpoint"
CURVE_ARTIFACT_DIR = "rollouts"
SAMPLE_GROUPS = 3  # groups shown in the metadata preview
PREVIEW_CHARS = 200

ROLLOUT_SCHEMA = pa.schema(
    [
        ("training_run_id", pa.string()),
        ("step", pa.int64()),
        ("group", pa.string()),
        ("sample", pa.int64()),
        ("tags", pa.list_(pa.string())),
        ("prompt", pa.string()),
        ("prompt_tokens", pa.list_(pa.int64())),
        ("completion", pa.string()),
        ("completion_tokens", pa.list_(pa.int64())),
        ("sampler_logprobs", pa.list_(pa.float64())),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("trained", pa.bool_()),
        ("num_turns", pa.int64()),
        ("correct", pa.float64()),
        ("sampler_step", pa.int64()),
        ("sampler_path", pa.string()),
        ("mlflow_run_id", pa.string()),
    ]
)


def rollout_table(rows: list[dict[str, Any]], training_run_id: str, mlflow_run_id: str) -> pa.Table:
    """Rows as a table with :data:`ROLLOUT_SCHEMA`, plus any env-specific text columns (e.g. sandbox status)."""
    known = set(ROLLOUT_SCHEMA.names)
    extra = sorted({key for row in rows for key in row} - known)
    schema = pa.schema([*ROLLOUT_SCHEMA, *(pa.field(name, pa.string()) for name in extra)])
    records = [
        {**{name: row.get(name) for name in known}, **{name: _text(row.get(name)) for name in extra},
         "training_run_id": training_run_id, "mlflow_run_id": mlflow_run_id}
        for row in sorted(rows, key=lambda r: (int(r["step"]), _group_order(r["group"]), int(r["sample"])))
    ]
    return pa.Table.from_pylist(records, schema=schema)


def step_summary(table: pa.Table) -> list[dict[str, float]]:
    """Per step: sample count, reward mean/std, accuracy (None when the env grades no correctness)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in table.select(["step", "reward", "correct"]).to_pylist():
        by_step[row["step"]].append(row)
    summary = []
    for step in sorted(by_step):
        rewards = [row["reward"] for row in by_step[step]]
        graded = [row["correct"] for row in by_step[step] if row["correct"] is not None]
        summary.append(
            {
                "step": step,
                "samples": len(rewards),
                "reward_mean": statistics.fmean(rewards),
                "reward_std": statistics.pstdev(rewards),
                "accuracy": statistics.fmean(graded) if graded else None,
            }
        )
    return summary


def summary_table(summary: list[dict[str, Any]]) -> dg.TableMetadataValue:
    """The per-step summary as a table the asset page shows inline (markdown this long hides behind a button)."""
    columns = [("step", "int"), ("samples", "int"), ("reward_mean", "float"), ("reward_std", "float"), ("accuracy", "float")]
    records = [
        dg.TableRecord({name: (round(entry[name], 4) if isinstance(entry[name], float) else entry[name]) for name, _ in columns})
        for entry in summary
    ]
    return dg.MetadataValue.table(records, schema=dg.TableSchema([dg.TableColumn(name, kind) for name, kind in columns]))


def curve_markdown(mlflow_run_id: str, artifact_path: str) -> str:
    """The reward curve as an image the asset page shows inline: the PNG logged to the MLflow run, fetched through
    the Dagster UI's /mlflow redirect (pipelines/webserver.py), so the markdown stays short enough to render."""
    query = urlencode({"path": artifact_path, "run_uuid": mlflow_run_id})
    return f"![reward mean ± std and accuracy per step]({mlflow_link('get-artifact')}?{query})"


def band(means: list[float], stds: list[float]) -> tuple[list[float], list[float]]:
    """mean ± std per step, clipped to the reward's range ([0, 1], widened to any mean outside it)."""
    low, high = min(0.0, *means), max(1.0, *means)
    return [max(low, m - s) for m, s in zip(means, stds)], [min(high, m + s) for m, s in zip(means, stds)]


def groups_markdown(table: pa.Table, limit: int = SAMPLE_GROUPS) -> str:
    """The first ``limit`` groups of the last step: prompt once, then each completion with reward and advantage."""
    rows = table.to_pylist()
    if not rows:
        return "no samples"
    last = max(row["step"] for row in rows)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["step"] == last:
            groups[row["group"]].append(row)
    lines = []
    for label in sorted(groups, key=_group_order)[:limit]:
        members = groups[label]
        lines += [f"**group {label}** (step {last}, sampler `{members[0]['sampler_path']}`)", "", f"> {_short(members[0]['prompt'])}", ""]
        for row in members:
            lines.append(f"- reward {row['reward']:+.3f}, advantage {row['advantage']:+.3f}: `{_short(row['completion'])}`")
        lines.append("")
    return "\n".join(lines)


def plot_curve(summary: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Reward mean ± std and accuracy per step, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [entry["step"] for entry in summary]
    means = [entry["reward_mean"] for entry in summary]
    stds = [entry["reward_std"] for entry in summary]
    figure, axes = plt.subplots(figsize=(4.4, 2.8), dpi=100)  # ~440 px: fits the asset page's value column
    axes.plot(steps, means, marker="o", label="reward mean")
    axes.fill_between(steps, *band(means, stds), alpha=0.2, label="± std")
    graded = [(entry["step"], entry["accuracy"]) for entry in summary if entry["accuracy"] is not None]
    if graded:
        axes.plot([s for s, _ in graded], [a for _, a in graded], marker="s", label="accuracy")
    axes.set_xlabel("step")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def build_rollouts_asset(name: str, training_asset: str, description: str) -> dg.AssetsDefinition:
    """``name``: the samples of the latest ``training_asset`` run (any recipe on the RL core writes them)."""

    @dg.asset(name=name, group_name=TRAINING_GROUP, kinds={"parquet", "mlflow"}, deps=[training_asset], description=description)
    def _rollouts(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> dg.Output[pa.Table]:
        return rollouts_output(context, mlflow, name, training_asset)

    return _rollouts


def rollouts_output(context: dg.AssetExecutionContext, mlflow: MlflowResource, name: str, training_asset: str) -> dg.Output[pa.Table]:
    training = latest_version(context.instance, training_asset)
    log_dir = Path(str(training.metadata.get("log_dir", "")))
    rollouts = log_dir / ROLLOUTS_FILE
    if not rollouts.exists():
        raise dg.Failure(
            f"the latest {training_asset} materialization (run {training.run_id}) has no {rollouts}: it was trained under "
            f"another POSTTRAIN_STATE_DIR, or before rollouts were recorded; re-materialize {training_asset}"
        )
    manifest = read_manifest(str(training.metadata["final_partition"]))
    table = rollout_table(JsonlRowSink(rollouts).read(), training_run_id=log_dir.name, mlflow_run_id=manifest.mlflow_run_id)
    summary = step_summary(table)
    curve = plot_curve(summary, state_subdir(name) / f"{log_dir.name}.png", f"{manifest.recipe} run {log_dir.name[:8]}: reward per step")
    mlflow.get_client().log_artifact(manifest.mlflow_run_id, str(curve), CURVE_ARTIFACT_DIR)
    return versioned_output(
        table,
        {
            "dagster/row_count": table.num_rows,
            "training_run_id": log_dir.name,
            "final_checkpoint": manifest.partition,
            "steps": len(summary),
            "reward_curve": dg.MetadataValue.md(curve_markdown(manifest.mlflow_run_id, f"{CURVE_ARTIFACT_DIR}/{curve.name}")),
            "reward_per_step": summary_table(summary),
            "sample_groups": dg.MetadataValue.md(groups_markdown(table)),
            "reward_curve_path": dg.MetadataValue.path(str(curve)),
            "mlflow_run": dg.MetadataValue.url(manifest.mlflow_run_url),
        },
        f"{log_dir.name}-{manifest.step}-{table.num_rows}",
    )


rollout_batches = build_rollouts_asset(
    "rollout_batches",
    TRAINING_ASSET,
    "Every sample of the latest rl_checkpoint run (prompt, completion, tokens, sampler logprobs, reward, "
    "advantage, turns) with the tinker:// sampler weights that produced it.",
)


def _group_order(label: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(label).split(".") if part.isdigit())


def _short(text: str) -> str:
    flat = " ".join(str(text).split()).replace("`", "'")
    return flat if len(flat) <= PREVIEW_CHARS else flat[:PREVIEW_CHARS] + "…"


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
