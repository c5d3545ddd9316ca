"""Reference-model logprobs of preference pairs, computed once and kept as an Arrow table.

DPO compares the policy with a frozen reference: the policy's initial weights (a snapshot taken before
the first step) or an explicit ``reference_model``. The reference never changes during a run, so its
logprobs are computed once, for every pair, and stored keyed by ``row_id``: the Dagster side keeps the
table as an asset, a β sweep reuses it, and a resumed run reads it back instead of scoring a
reference that no longer exists (the initial weights are gone once training has stepped).

Scoring uses ``SamplingClient.compute_logprobs`` on each side's unshifted sequence; element ``t + 1`` of
its result is the logprob of ``target_tokens[t]``. Every request is submitted before any is awaited.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import tinker

from posttrain.preference.data import SIDES, Pair

REFERENCE_LOGPROBS = pa.schema(
    [
        ("row_id", pa.string()),
        ("chosen_ref_logprob_sum", pa.float64()),
        ("rejected_ref_logprob_sum", pa.float64()),
        ("chosen_ref_logprobs", pa.list_(pa.float32())),
        ("rejected_ref_logprobs", pa.list_(pa.float32())),
    ],
    metadata={"posttrain.schema": "reference_logprobs"},
)
"""Per pair: the reference's weighted logprob sum of each side (what the DPO loss uses) and its
per-target-token logprobs (aligned with ``<side>_target_tokens``)."""


def reference_sampling_client(
    service_client: tinker.ServiceClient,
    *,
    reference_model: str | None = None,
    training_client: tinker.TrainingClient | None = None,
    snapshot_name: str = "dpo-reference",
) -> tinker.SamplingClient:
    """The reference to score with: ``reference_model`` (a ``tinker://.../sampler_weights/...`` path or a
    base-model name), else a snapshot of ``training_client``'s current (initial) weights."""
    if reference_model:
        if reference_model.startswith("tinker://"):
            if "/sampler_weights/" not in reference_model:
                raise ValueError(
                    f"reference_model {reference_model!r} is not a sampler checkpoint: pass the "
                    "tinker://<run>/sampler_weights/<name> path of the checkpoint (its sampler_path)"
                )
            return service_client.create_sampling_client(model_path=reference_model).result()
        return service_client.create_sampling_client(base_model=reference_model).result()
    if training_client is None:
        raise ValueError("reference_sampling_client needs a reference_model or the training_client to snapshot")
    return training_client.save_weights_and_get_sampling_client(snapshot_name).result()


def _side_logprobs(raw: Sequence[float | None], pair: Pair, side: str) -> np.ndarray:
    expected = len(getattr(pair, side).target_tokens)
    scored = np.asarray([np.nan if value is None else value for value in raw[1:]], dtype=np.float64)
    if scored.shape != (expected,):
        raise RuntimeError(f"compute_logprobs returned {len(raw)} values for the {expected + 1}-token {side} side of {pair.row_id!r}")
    return scored


def compute_reference_logprobs(sampling_client: tinker.SamplingClient, pairs: Sequence[Pair]) -> pa.Table:
    """A ``REFERENCE_LOGPROBS`` table with one row per pair, in the order given."""
    futures = [
        {side: sampling_client.compute_logprobs(tinker.ModelInput.from_ints(getattr(pair, side).full_sequence())) for side in SIDES}
        for pair in pairs
    ]
    columns: dict[str, list] = {name: [] for name in REFERENCE_LOGPROBS.names}
    for pair, pending in zip(pairs, futures):
        columns["row_id"].append(pair.row_id)
        for side in SIDES:
            logprobs = _side_logprobs(pending[side].result(), pair, side)
            weights = np.asarray(getattr(pair, side).weights, dtype=np.float64)
            columns[f"{side}_ref_logprob_sum"].append(float((logprobs * weights).sum()))
            columns[f"{side}_ref_logprobs"].append(logprobs.astype(np.float32))
    return pa.Table.from_pydict(columns, schema=REFERENCE_LOGPROBS)


@dataclass(frozen=True)
class ReferenceSums:
    """The reference's per-side sums, looked up by row id."""

    by_row_id: dict[str, tuple[float, float]]

    @classmethod
    def from_table(cls, table: pa.Table) -> ReferenceSums:
        missing = [name for name in ("row_id", "chosen_ref_logprob_sum", "rejected_ref_logprob_sum") if name not in table.column_names]
        if missing:
            raise ValueError(f"reference table lacks columns {missing}: build it with compute_reference_logprobs")
        columns = table.select(["row_id", "chosen_ref_logprob_sum", "rejected_ref_logprob_sum"]).to_pydict()
        sums = dict(zip(columns["row_id"], zip(columns["chosen_ref_logprob_sum"], columns["rejected_ref_logprob_sum"])))
        nonfinite = [row_id for row_id, values in sums.items() if not np.all(np.isfinite(values))]
        if nonfinite:
            raise ValueError(f"reference logprobs of {nonfinite[:5]} are not finite: recompute the reference table")
        return cls(sums)

    def check_covers(self, row_ids: Sequence[str]) -> None:
        missing = [row_id for row_id in row_ids if row_id not in self.by_row_id]
        if missing:
            raise ValueError(
                f"the reference logprobs miss {len(missing)} of {len(row_ids)} pairs (e.g. {missing[:5]}): they were "
                "computed for other pairs; recompute them for this preference table"
            )

    def for_rows(self, row_ids: Sequence[str]) -> tuple[list[float], list[float]]:
        """(chosen sums, rejected sums) of ``row_ids``, in that order."""
        self.check_covers(row_ids)
        return [self.by_row_id[r][0] for r in row_ids], [self.by_row_id[r][1] for r in row_ids]
