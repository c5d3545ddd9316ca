"""The base model every fine-tune starts from: which model, where its weights come from, and a digest.

Its data version is the digest of the weights, so a different base model (or re-converted weights)
makes every checkpoint trained on the old one stale in the asset graph.

It also records the model's tokenizer (`tokenizer_name`, `tokenizer_digest`): the token assets
(`rendered_tokens`, `preference_pairs`) depend on this asset and render with exactly that tokenizer
(`materialized_base_model`), never with one named in their own config.
"""


from dataclasses import dataclass

import dagster as dg
from pydantic import Field

from posttrain.datasets.tokens import TokenizerIdentity, recorded_tokenizer, tokenizer_identity
from resources.models import load_tokenizer, tokenizer_path
from resources.tinker import TinkerResource

BASE_MODEL_KEY = dg.AssetKey("base_model")


class BaseModelConfig(dg.Config):
    name: str = Field(
        default="",
        description="Base model (hub id, localtinker name or local HF dir). Empty: the Tinker resource's default.",
    )


def tokenizer_metadata(model_name: str) -> dict[str, str]:
    """The tokenizer identity of `model_name`, or why it could not be loaded (a hosted model whose
    tokenizer is not on this machine: token assets then fail with this reason)."""
    try:
        identity = tokenizer_identity(load_tokenizer(model_name), model_name)
    except (OSError, ValueError) as error:
        return {"tokenizer_error": str(error)}
    return {"tokenizer_name": identity.name, "tokenizer_digest": identity.digest, "tokenizer_path": tokenizer_path(model_name)}


@dg.asset(group_name="training", kinds={"tinker", "huggingface"})
def base_model(config: BaseModelConfig, tinker: TinkerResource) -> dg.MaterializeResult:
    """The base model, resolved on the configured Tinker backend, identified by a content digest."""
    source = tinker.base_model_source(config.name or None)
    return dg.MaterializeResult(
        metadata={
            "base_model": source.name,
            "weights_location": source.location,
            "digest": source.digest,
            **tokenizer_metadata(source.name),
            **tinker.describe(),
        },
        data_version=dg.DataVersion(source.digest[:16]),
    )


@dataclass(frozen=True)
class MaterializedBaseModel:
    name: str
    tokenizer: TokenizerIdentity


def materialized_base_model(instance: dg.DagsterInstance, consumer: str) -> MaterializedBaseModel:
    """The latest `base_model` materialization's model name and tokenizer identity, for an asset that
    declares `deps=[BASE_MODEL_KEY]`; a Failure naming `consumer` and the fix when there is none."""
    event = instance.get_latest_materialization_event(BASE_MODEL_KEY)
    if event is None or event.asset_materialization is None:
        raise dg.Failure(description=f"{consumer}: base_model has never been materialized; materialize base_model first")
    metadata = event.asset_materialization.metadata
    name = str(getattr(metadata.get("base_model"), "value", ""))
    identity = recorded_tokenizer(metadata)
    if identity is None:
        reason = getattr(metadata.get("tokenizer_error"), "value", "it was materialized before tokenizers were recorded")
        raise dg.Failure(
            description=f"{consumer}: the base_model materialization ({name!r}) records no tokenizer ({reason}); "
            "re-materialize base_model with a model whose tokenizer loads on this machine"
        )
    return MaterializedBaseModel(name=name, tokenizer=identity)
