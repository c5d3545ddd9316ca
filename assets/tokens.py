"""`rendered_tokens`: the chat dataset rendered to exactly what the model will be trained on.

One row per conversation (same row ids and `split` as `chat_dataset`), shifted for training; the
metadata shows token-count percentiles, truncation, the trained-token fraction and a decoded preview
with the trained tokens between ⟦ and ⟧.

The tokenizer comes from the `base_model` asset (a graph dependency), never from this asset's config,
and its identity (name + digest) is recorded in the metadata and in the parquet schema metadata, so
training refuses tokens rendered for another model (`posttrain.datasets.tokens.check_tokenizer_matches`).
"""

from collections.abc import Iterator

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from assets.base_model import BASE_MODEL_KEY, materialized_base_model
from assets.datasets import DATA_GROUP, blocking, checked_table_output, data_errors, failures_check, schema_check, table_output
from posttrain.datasets import schemas, summary, tokens
from posttrain.datasets.rows import EmptyDatasetError, SkipLog
from posttrain.datasets.tokens import TokenizerIdentity, check_tokenizer_matches, tokenizer_identity, with_tokenizer_identity
from posttrain.renderers import get_renderer
from resources.models import load_tokenizer, tokenizer_path

PREVIEW_ROWS = 3


class RenderConfig(dg.Config):
    renderer: str = Field(
        default="auto",
        description="Renderer name; 'auto' = the one recommended for the base model (chatml for SmolLM2, llama3 for "
        "Llama 3 Instruct, qwen3 for Qwen3, deepseekv3 ...), or name one (chatml, llama3, qwen3, role_colon, tml:<family> ...).",
    )
    train_on_what: str = Field(
        default="last_assistant_message",
        description="Which tokens carry loss weight: last_assistant_message, all_assistant_messages, all_messages, ...",
    )
    max_length: int | None = Field(default=2048, description="Truncate rendered sequences to this many tokens.")
    skip_bad_rows: bool = Field(
        default=False,
        description="Drop examples left with no trained token (e.g. truncated away) and report them, instead of "
        "failing the blocking check.",
    )


def base_model_tokenizer(context: dg.AssetExecutionContext, consumer: str) -> tuple[object, TokenizerIdentity]:
    """The tokenizer of the materialized base_model and its identity, after checking that the tokenizer
    loaded now is the one base_model recorded (its files did not change since)."""
    base = materialized_base_model(context.instance, consumer)
    tokenizer = load_tokenizer(base.name)
    identity = tokenizer_identity(tokenizer, base.name)
    check_tokenizer_matches(identity, base.tokenizer)
    context.log.info(f"{consumer}: tokenizer of base model {base.name} ({tokenizer_path(base.name)})")
    return tokenizer, identity


def tokenizer_identity_metadata(identity: TokenizerIdentity) -> dict[str, dg.MetadataValue]:
    return {
        "base_model": dg.MetadataValue.text(identity.name),
        "tokenizer_name": dg.MetadataValue.text(identity.name),
        "tokenizer_digest": dg.MetadataValue.text(identity.digest),
    }


def token_metadata(num_tokens: list[int], num_trained: list[int], num_targets: list[int], truncated: int) -> dict:
    stats = summary.percentiles(num_tokens)
    metadata = {f"tokens/{key}": dg.MetadataValue.float(float(value)) for key, value in stats.items()}
    metadata["tokens/total"] = dg.MetadataValue.int(int(sum(num_tokens)))
    metadata["trained_tokens/total"] = dg.MetadataValue.int(int(sum(num_trained)))
    metadata["trained_token_fraction"] = dg.MetadataValue.float(round(summary.trained_fraction(num_trained, num_targets), 4))
    metadata["truncated_rows"] = dg.MetadataValue.int(truncated)
    return metadata


def token_preview(table: pa.Table, tokenizer, prefix: str = "", limit: int = PREVIEW_ROWS) -> list[tuple[str, str]]:
    """(row id, decoded text with trained tokens marked) of the first rows."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    examples = []
    for row in table.slice(0, limit).to_pylist():
        full, weights = summary.unshift(row[f"{prefix}model_input"], row[f"{prefix}target_tokens"], row[f"{prefix}weights"])
        examples.append((f"{row['row_id']} {prefix.rstrip('_')}".strip(), summary.mark_trained(full, weights, decode)))
    return examples


def drop_untrained(table: pa.Table, trained_columns: list[str], skip: SkipLog) -> pa.Table:
    """Rows with zero trained tokens in any of `trained_columns`, removed and recorded in `skip`."""
    keep = pc.greater(table.column(trained_columns[0]), 0)
    for column in trained_columns[1:]:
        keep = pc.and_(keep, pc.greater(table.column(column), 0))
    for row_id in table.filter(pc.invert(keep)).column("row_id").to_pylist():
        skip.record(f"{row_id}: no trained tokens (truncated away or nothing to train)")
    return table.filter(keep)


def untrained_failures(table: pa.Table, column: str) -> list[str]:
    return [f"{r['row_id']}: no trained tokens" for r in table.select(["row_id", column]).to_pylist() if r[column] == 0]


def length_failures(table: pa.Table, max_length: int | None, input_column: str) -> list[str]:
    if max_length is None:
        return []
    lengths = pc.add(pc.list_value_length(table.column(input_column)), 1).to_pylist()
    return [f"{row_id}: {n} tokens > max_length {max_length}" for row_id, n in zip(table.column("row_id").to_pylist(), lengths, strict=True) if n > max_length]


@dg.asset(
    group_name=DATA_GROUP,
    kinds={"parquet"},
    deps=[BASE_MODEL_KEY],
    check_specs=blocking(
        "rendered_tokens",
        ("schema_valid", "Table has the normalized rendered-token schema."),
        ("every_example_trained", "Every example has at least one trained token."),
        ("within_max_length", "No sequence exceeds max_length (longer ones are truncated and counted)."),
    ),
    description="Chat dataset rendered with the base model's tokenizer to shifted token sequences with loss "
    "weights (split column kept); the tokenizer identity is recorded in metadata and parquet schema.",
)
def rendered_tokens(context: dg.AssetExecutionContext, config: RenderConfig, chat_dataset: pa.Table) -> Iterator:
    skip = SkipLog(skip_bad_rows=config.skip_bad_rows)
    with data_errors("rendered_tokens"):
        tokenizer, identity = base_model_tokenizer(context, "rendered_tokens")
        renderer = get_renderer(config.renderer, tokenizer, base_model=identity.name)
        table = tokens.render_chat_table(chat_dataset, renderer, config.train_on_what, config.max_length, skip)
        if config.skip_bad_rows:
            table = drop_untrained(table, ["num_trained_tokens"], skip)
        if table.num_rows == 0:
            raise EmptyDatasetError(f"no examples left to train on ({skip.count} had no trained token)")
    table = with_tokenizer_identity(table, identity)
    context.log.info(f"rendered {table.num_rows} examples with {renderer.name}")
    truncated = int(pc.sum(table.column("truncated")).as_py() or 0)
    metadata = {
        "renderer": dg.MetadataValue.text(renderer.name),
        **tokenizer_identity_metadata(identity),
        "train_on_what": dg.MetadataValue.text(config.train_on_what),
        "max_length": dg.MetadataValue.int(config.max_length or 0),
        "skipped_rows": dg.MetadataValue.int(skip.count),
        "preview": dg.MetadataValue.md(summary.preview_markdown(token_preview(table, tokenizer), "rendered_tokens")),
        **token_metadata(
            table.column("num_tokens").to_pylist(),
            table.column("num_trained_tokens").to_pylist(),
            pc.list_value_length(table.column("target_tokens")).to_pylist(),
            truncated,
        ),
    }
    if skip.samples:
        metadata["skipped_samples"] = dg.MetadataValue.md("\n".join(f"- {s}" for s in skip.samples))
    yield from checked_table_output(
        "rendered_tokens",
        table_output(table, metadata),
        [
            schema_check(table, schemas.RENDERED_TOKENS),
            failures_check("every_example_trained", untrained_failures(table, "num_trained_tokens")),
            failures_check(
                "within_max_length",
                length_failures(table, config.max_length, "model_input"),
                truncated_rows=dg.MetadataValue.int(truncated),
            ),
        ],
    )
