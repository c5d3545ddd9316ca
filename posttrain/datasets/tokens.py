"""Chat tables -> rendered token sequences; preference comparisons -> rendered pairs.

Rendering is done by `posttrain.renderers.batch.render_supervised_batch` (one batched tokenizer call
for a whole table). Here we only shift the sequences into the training layout (input i predicts
target i) and put them in the normalized Arrow schemas.

Token ids mean nothing without their tokenizer, so every token table carries the identity of the
tokenizer that produced it (`TokenizerIdentity`: a name and a digest of the tokenizer's vocabulary,
merges and special tokens) in its parquet schema metadata, and training calls
`check_tokenizer_matches` before it consumes the table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from posttrain.datasets import schemas
from posttrain.datasets.rows import BadRowError, SkipLog, compact_messages


TOKENIZER_METADATA_KEY = b"posttrain.tokenizer"
_RUNTIME_TOKENIZER_STATE = ("truncation", "padding")  # set per call by transformers, not part of the vocabulary
MIN_MAX_LENGTH = 2  # the shortest sequence that still has one (input, target) pair


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer produced a token table: `name` says which (a base model or tokenizer path),
    `digest` decides whether two tokenizers are the same (two names may share one tokenizer)."""

    name: str
    digest: str

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "digest": self.digest}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TokenizerIdentity:
        data = json.loads(text)
        return cls(name=str(data["name"]), digest=str(data["digest"]))

    def describe(self) -> str:
        return f"{self.name!r} (tokenizer digest {self.digest[:12]})"


class TokenizerMismatch(ValueError):
    """Tokens rendered with one tokenizer were about to be trained on a model with another."""


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of a tokenizer's canonical description: the full serialization of a fast (Rust) tokenizer
    (vocabulary, merges, normalizer, pre-tokenizer, added and special tokens) with keys sorted, else
    its vocabulary and special tokens. Two loads of the same files give the same digest."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        description = json.loads(backend.to_str())
        for key in _RUNTIME_TOKENIZER_STATE:
            description.pop(key, None)
    elif hasattr(tokenizer, "get_vocab"):
        description = {"vocab": tokenizer.get_vocab(), "special": sorted(getattr(tokenizer, "all_special_tokens", []))}
    else:
        raise TypeError(
            f"tokenizer_digest: cannot describe a {type(tokenizer).__name__}; pass a transformers tokenizer "
            "(one with backend_tokenizer or get_vocab)"
        )
    canonical = json.dumps(description, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer: Any, name: str) -> TokenizerIdentity:
    return TokenizerIdentity(name=name, digest=tokenizer_digest(tokenizer))


def with_tokenizer_identity(table: pa.Table, identity: TokenizerIdentity) -> pa.Table:
    """`table` with `identity` in its schema metadata (kept by parquet, so it travels with the file)."""
    metadata = dict(table.schema.metadata or {})
    metadata[TOKENIZER_METADATA_KEY] = identity.to_json().encode("utf-8")
    return table.replace_schema_metadata(metadata)


def recorded_tokenizer(source: pa.Table | pa.Schema | Mapping[str, Any] | TokenizerIdentity) -> TokenizerIdentity | None:
    """The tokenizer identity recorded in a token table / its schema, or in a Dagster metadata mapping
    (keys `tokenizer_name` and `tokenizer_digest`, values plain or `MetadataValue`); None when absent."""
    if isinstance(source, TokenizerIdentity):
        return source
    if isinstance(source, (pa.Table, pa.Schema)):
        schema = source.schema if isinstance(source, pa.Table) else source
        raw = (schema.metadata or {}).get(TOKENIZER_METADATA_KEY)
        return TokenizerIdentity.from_json(raw) if raw is not None else None
    values = {key: getattr(value, "value", value) for key, value in source.items()}
    if "tokenizer_digest" not in values:
        return None
    return TokenizerIdentity(name=str(values.get("tokenizer_name", "")), digest=str(values["tokenizer_digest"]))


def check_tokenizer_matches(
    table_or_metadata: pa.Table | pa.Schema | Mapping[str, Any] | TokenizerIdentity, expected: TokenizerIdentity
) -> TokenizerIdentity:
    """Raise TokenizerMismatch unless the tokens were rendered with `expected`'s tokenizer (same digest);
    the error names both. Returns the recorded identity. Call it before training on a token table."""
    recorded = recorded_tokenizer(table_or_metadata)
    if recorded is None:
        raise TokenizerMismatch(
            f"the token table records no tokenizer, so it cannot be checked against the model's "
            f"{expected.describe()}; re-materialize it (rendered_tokens / preference_pairs) to record one"
        )
    if recorded.digest != expected.digest:
        raise TokenizerMismatch(
            f"tokens were rendered with {recorded.describe()} but the model being trained uses "
            f"{expected.describe()}; re-render the tokens from this base model (materialize base_model, then "
            "the token asset) or train the model they were rendered for"
        )
    return recorded


def _renderers():
    from posttrain.renderers import TrainOnWhat, get_renderer
    from posttrain.renderers.batch import render_supervised_batch

    return TrainOnWhat, get_renderer, render_supervised_batch


def train_on_what(name: str):
    """TrainOnWhat by (case-insensitive) name, with the valid names in the error."""
    train_on_what_enum, _, _ = _renderers()
    for member in train_on_what_enum:
        if name.lower() in (member.name.lower(), str(member.value).lower()):
            return member
    valid = ", ".join(m.name.lower() for m in train_on_what_enum)
    raise ValueError(f"unknown train_on_what {name!r}; expected one of {valid}")


def shift(tokens: Sequence[int], weights: Sequence[float]) -> tuple[list[int], list[int], list[float]]:
    """(model_input, target_tokens, target weights): position i of the input predicts token i + 1."""
    return list(tokens[:-1]), list(tokens[1:]), list(weights[1:])


def render_chat_table(
    table: pa.Table, renderer, train_on: str, max_length: int | None, skip: SkipLog | None = None
) -> pa.Table:
    """One RENDERED_TOKENS row per chat row (same order and row ids). A conversation the renderer
    rejects raises, naming its row id, or is recorded in `skip` when it allows skipping."""
    _, _, render_batch = _renderers()
    skip = skip or SkipLog()
    row_ids = table.column("row_id").to_pylist()
    splits = table.column("split").to_pylist()
    conversations = [compact_messages(messages) for messages in table.column("messages").to_pylist()]
    batch = _render(render_batch, renderer, conversations, train_on_what(train_on), max_length, row_ids, skip)
    rows = []
    for position, index in enumerate(batch["row_index"]):
        model_input, targets, weights = shift(batch["tokens"][position], batch["weights"][position])
        rows.append(
            {
                "row_id": row_ids[index],
                "source_row_id": row_ids[index],
                "split": splits[index],
                "model_input": model_input,
                "target_tokens": targets,
                "weights": weights,
                "num_tokens": batch["num_tokens"][position],
                "num_trained_tokens": int(sum(1 for w in weights if w > 0)),
                "truncated": bool(batch["truncated"][position]),
            }
        )
    return schemas.table_from_rows(rows, schemas.RENDERED_TOKENS)


def _render(render_batch, renderer, conversations, train_on, max_length, row_ids, skip: SkipLog) -> dict[str, list]:
    """render_supervised_batch, with its errors re-labelled by row id (not position)."""
    from posttrain.renderers import RendererError

    if max_length is not None and max_length < MIN_MAX_LENGTH:
        raise ValueError(
            f"max_length={max_length} leaves no token to train on (a shifted sequence needs an input and a target): "
            f"set max_length >= {MIN_MAX_LENGTH}, or null for no truncation"
        )
    errors = "skip" if skip.skip_bad_rows else "raise"
    try:
        batch = render_batch(renderer, conversations, train_on_what=train_on, max_length=max_length, errors=errors)
    except RendererError as error:
        index = _conversation_index(str(error))
        where = row_ids[index] if index is not None and index < len(row_ids) else "a conversation"
        raise BadRowError(where, f"cannot be rendered: {error}") from error
    for index, reason in batch.skipped:
        skip.reject(BadRowError(row_ids[index], f"cannot be rendered: {reason}"))
    return batch.columns()


def _conversation_index(message: str) -> int | None:
    prefix = "conversation "
    if message.startswith(prefix):
        number = message[len(prefix):].split(":", 1)[0]
        return int(number) if number.isdigit() else None
    return None


def first_trained_index(weights: Sequence[float]) -> int:
    """Index of the first token with weight > 0 (len(weights) when none)."""
    return next((i for i, w in enumerate(weights) if w > 0), len(weights))


def render_comparisons_table(table: pa.Table, renderer, max_length: int | None, skip: SkipLog | None = None) -> pa.Table:
    """One PREFERENCE_PAIRS row per comparison: prompt + chosen and prompt + rejected rendered with only
    the completion trained (LAST_ASSISTANT_MESSAGE), raw 0/1 weights as DPO sums them."""
    train_on_what_enum, _, render_batch = _renderers()
    skip = skip or SkipLog()
    row_ids = table.column("row_id").to_pylist()
    splits = table.column("split").to_pylist()
    prompts = [compact_messages(messages) for messages in table.column("prompt").to_pylist()]
    last = train_on_what_enum.LAST_ASSISTANT_MESSAGE
    rendered = {}
    for side in ("chosen", "rejected"):
        conversations = [p + compact_messages(c) for p, c in zip(prompts, table.column(side).to_pylist(), strict=True)]
        columns = _render(render_batch, renderer, conversations, last, max_length, row_ids, skip)
        rendered[side] = {index: position for position, index in enumerate(columns["row_index"])}, columns
    rows = []
    for index, row_id in enumerate(row_ids):
        if any(index not in rendered[side][0] for side in rendered):
            continue
        row: dict[str, Any] = {"row_id": row_id, "source_row_id": row_id, "split": splits[index]}
        prompt_lengths, truncated = [], False
        for side, (positions, columns) in rendered.items():
            position = positions[index]
            tokens, weights = columns["tokens"][position], columns["weights"][position]
            prompt_lengths.append(first_trained_index(weights))
            model_input, targets, shifted_weights = shift(tokens, weights)
            row[f"{side}_model_input"] = model_input
            row[f"{side}_target_tokens"] = targets
            row[f"{side}_weights"] = shifted_weights
            row[f"{side}_num_trained_tokens"] = int(sum(1 for w in shifted_weights if w > 0))
            truncated = truncated or bool(columns["truncated"][position])
        row["prompt_length"] = min(prompt_lengths)
        row["truncated"] = truncated
        rows.append(row)
    return schemas.table_from_rows(rows, schemas.PREFERENCE_PAIRS)


def pair_problems(table: pa.Table) -> list[str]:
    """Row ids (with the reason) of pairs that are identical, do not share their prompt tokens, or have
    an untrained side; empty when every pair is usable for DPO."""
    problems = []
    for row in table.select(
        ["row_id", "prompt_length", "chosen_model_input", "chosen_target_tokens", "rejected_model_input",
         "rejected_target_tokens", "chosen_num_trained_tokens", "rejected_num_trained_tokens"]
    ).to_pylist():
        chosen = row["chosen_model_input"] + row["chosen_target_tokens"][-1:]
        rejected = row["rejected_model_input"] + row["rejected_target_tokens"][-1:]
        length = row["prompt_length"]
        if chosen == rejected:
            problems.append(f"{row['row_id']}: chosen and rejected render to the same tokens")
        elif length == 0 or chosen[:length] != rejected[:length]:
            problems.append(f"{row['row_id']}: chosen and rejected do not share their first {length} prompt tokens")
        elif min(row["chosen_num_trained_tokens"], row["rejected_num_trained_tokens"]) == 0:
            problems.append(f"{row['row_id']}: a side has no trained tokens (completion truncated away?)")
    return problems
