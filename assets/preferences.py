"""Preference data for DPO: `preference_comparisons` (messages) and `preference_pairs` (rendered tokens).

The default source generates comparisons offline from reasoning-gym: chosen = the verified gold answer,
rejected = a wrong answer of the same form that the task's scorer marks wrong.

`preference_pairs` renders with the tokenizer of the materialized `base_model` (a graph dependency) and
records its identity like `rendered_tokens` does; its split is the comparison's, chosen by prompt.
`build_pairs_asset` is that rendering for any comparisons asset (`onpolicy_pairs` in `assets.dpo` too).
"""

from collections.abc import Iterator

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from assets.base_model import BASE_MODEL_KEY
from assets.datasets import (
    DATA_GROUP,
    SourceConfig,
    blocking,
    checked_table_output,
    data_errors,
    failures_check,
    loaded_output,
    messages_preview,
    schema_check,
    table_output,
)
from assets.tokens import (
    base_model_tokenizer,
    drop_untrained,
    length_failures,
    token_metadata,
    token_preview,
    tokenizer_identity_metadata,
)
from posttrain.datasets import schemas, summary, tokens
from posttrain.datasets.loaders import load
from posttrain.datasets.rows import EmptyDatasetError, SkipLog
from posttrain.datasets.tokens import with_tokenizer_identity
from posttrain.renderers import get_renderer


class ComparisonSourceConfig(SourceConfig):
    source: str = Field(
        default="reasoning_gym:basic_arithmetic,chain_sum",
        description="Comparison preset (hh_rlhf, hhh_alignment, ultrafeedback, helpsteer3), any hub id / file "
        "with prompt/chosen/rejected columns, or 'reasoning_gym:<tasks>' (verified vs wrong answers).",
    )


class PairRenderConfig(dg.Config):
    renderer: str = Field(default="auto", description="Renderer name; 'auto' = the one recommended for the base model.")
    max_length: int | None = Field(default=2048, description="Truncate each rendered side to this many tokens.")
    skip_bad_rows: bool = Field(default=False, description="Drop pairs left with an untrained side and report them.")


def identical_failures(table: pa.Table) -> list[str]:
    rows = table.select(["row_id", "chosen", "rejected"]).to_pylist()
    return [f"{r['row_id']}: chosen == rejected" for r in rows if r["chosen"] == r["rejected"]]


@dg.asset(
    group_name=DATA_GROUP,
    kinds={"parquet", "huggingface"},
    check_specs=blocking(
        "preference_comparisons",
        ("schema_valid", "Table has the normalized preference-comparison schema."),
        ("pairs_differ", "Chosen and rejected completions differ in every row."),
    ),
    description="Prompt + chosen + rejected conversations, normalized from a preset, file or generator.",
)
def preference_comparisons(config: ComparisonSourceConfig) -> Iterator:
    with data_errors("preference_comparisons"):
        loaded = load(config.load_spec("comparison"))
    yield from checked_table_output(
        "preference_comparisons",
        loaded_output(loaded, messages_preview(loaded.table, ("prompt", "chosen", "rejected"))),
        [
            schema_check(loaded.table, schemas.PREFERENCE_COMPARISONS),
            failures_check("pairs_differ", identical_failures(loaded.table)),
        ],
    )


def build_pairs_asset(name: str, comparisons_asset: str, description: str) -> dg.AssetsDefinition:
    """A pair-rendering asset ``name`` over the comparisons table ``comparisons_asset``.

    One code path for offline (``preference_pairs``) and on-policy (``onpolicy_pairs``) pairs: the same
    renderer, truncation, skip policy, metadata and blocking checks, whatever produced the comparisons.
    """

    @dg.asset(
        name=name,
        group_name=DATA_GROUP,
        kinds={"parquet"},
        deps=[BASE_MODEL_KEY],
        ins={"comparisons": dg.AssetIn(comparisons_asset)},
        check_specs=blocking(
            name,
            ("schema_valid", "Table has the normalized preference-pair schema."),
            ("pairs_differ_and_share_prompt", "Chosen/rejected tokens differ, share their prompt tokens, both trained."),
            ("within_max_length", "No side exceeds max_length (longer ones are truncated and counted)."),
        ),
        description=description,
    )
    def _pairs(context: dg.AssetExecutionContext, config: PairRenderConfig, comparisons: pa.Table) -> Iterator:
        yield from render_pairs(context, name, config, comparisons)

    return _pairs


def render_pairs(context: dg.AssetExecutionContext, name: str, config: PairRenderConfig, comparisons: pa.Table) -> Iterator:
    skip = SkipLog(skip_bad_rows=config.skip_bad_rows)
    with data_errors(name):
        tokenizer, identity = base_model_tokenizer(context, name)
        renderer = get_renderer(config.renderer, tokenizer, base_model=identity.name)
        table = tokens.render_comparisons_table(comparisons, renderer, config.max_length, skip)
        if config.skip_bad_rows:
            table = drop_untrained(table, ["chosen_num_trained_tokens", "rejected_num_trained_tokens"], skip)
        if table.num_rows == 0:
            raise EmptyDatasetError(f"no pairs left ({skip.count} had an untrained side)")
    table = with_tokenizer_identity(table, identity)
    context.log.info(f"{name}: rendered {table.num_rows} preference pairs with {renderer.name}")
    lengths = [
        pc.add(pc.list_value_length(table.column(f"{side}_model_input")), 1).to_pylist() for side in ("chosen", "rejected")
    ]
    targets = [pc.list_value_length(table.column(f"{side}_target_tokens")).to_pylist() for side in ("chosen", "rejected")]
    trained = [table.column(f"{side}_num_trained_tokens").to_pylist() for side in ("chosen", "rejected")]
    preview = token_preview(table, tokenizer, "chosen_", limit=2) + token_preview(table, tokenizer, "rejected_", limit=2)
    truncated = int(pc.sum(table.column("truncated")).as_py() or 0)
    metadata = {
        "renderer": dg.MetadataValue.text(renderer.name),
        **tokenizer_identity_metadata(identity),
        "max_length": dg.MetadataValue.int(config.max_length or 0),
        "skipped_rows": dg.MetadataValue.int(skip.count),
        "preview": dg.MetadataValue.md(summary.preview_markdown(preview, name)),
        **token_metadata(lengths[0] + lengths[1], trained[0] + trained[1], targets[0] + targets[1], truncated),
    }
    if skip.samples:
        metadata["skipped_samples"] = dg.MetadataValue.md("\n".join(f"- {s}" for s in skip.samples))
    yield from checked_table_output(
        name,
        table_output(table, metadata),
        [
            schema_check(table, schemas.PREFERENCE_PAIRS),
            failures_check("pairs_differ_and_share_prompt", tokens.pair_problems(table)),
            failures_check(
                "within_max_length",
                length_failures(table, config.max_length, "chosen_model_input")
                + length_failures(table, config.max_length, "rejected_model_input"),
                truncated_rows=dg.MetadataValue.int(truncated),
            ),
        ],
    )


preference_pairs = build_pairs_asset(
    "preference_pairs",
    "preference_comparisons",
    "Comparisons rendered to chosen/rejected token sequences sharing a prompt (DPO input).",
)
