"""The checkpoints that are their recipe's MLflow ``best`` now: what the benchmark and export sensors follow."""

from mlflow.exceptions import MlflowException

from assets.checkpoint_manifest import CheckpointManifest
from resources.mlflow import ALIAS_BEST, MlflowResource


def best_manifests(manifests: list[CheckpointManifest], mlflow: MlflowResource) -> list[CheckpointManifest]:
    """The manifests whose model version is their registered model's ``best`` now (a model without one: none)."""
    best: dict[str, str | None] = {}
    for name in {manifest.registered_model for manifest in manifests}:
        try:
            best[name] = str(mlflow.resolve_alias(name, ALIAS_BEST).version)
        except (LookupError, MlflowException):
            best[name] = None
    return [manifest for manifest in manifests if best.get(manifest.registered_model) == str(manifest.model_version)]
