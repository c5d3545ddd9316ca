"""The base model every fine-tune starts from: which model, where its weights come from, and a digest.

Its data version is the digest of the weights, so a different base model (or re-converted weights)
makes every checkpoint trained on the old one stale in the asset graph.
"""

import dagster as dg
from pydantic import Field

from resources.tinker import TinkerResource


class BaseModelConfig(dg.Config):
    name: str = Field(
        default="",
        description="Base model (hub id, localtinker name or local HF dir). Empty: the Tinker resource's default.",
    )


@dg.asset(group_name="training", kinds={"tinker", "huggingface"})
def base_model(config: BaseModelConfig, tinker: TinkerResource) -> dg.MaterializeResult:
    """The base model, resolved on the configured Tinker backend, identified by a content digest."""
    source = tinker.base_model_source(config.name or None)
    return dg.MaterializeResult(
        metadata={
            "base_model": source.name,
            "weights_location": source.location,
            "digest": source.digest,
            **tinker.describe(),
        },
        data_version=dg.DataVersion(source.digest[:16]),
    )
