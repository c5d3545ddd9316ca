"""init_from: every way a user names a starting checkpoint, and the errors for names that do not resolve."""

import pytest

from assets.chaining import InitFromError, SamplerModel, resolve_init_from
from assets.checkpoint_manifest import CheckpointManifest, write_manifest


def _manifest(partition, recipe="sft", version="1", base="m", step=10, state=True):
    manifest = CheckpointManifest(
        partition=partition, recipe=recipe, name=f"{step:06d}", step=step, epoch=0, final=False,
        state_path=f"tinker://{partition}/weights/{step:06d}" if state else None,
        sampler_path=f"tinker://{partition}/sampler_weights/{step:06d}", base_model=base, base_model_digest="d",
        renderer="chatml", training_dagster_run_id="r", training_asset=f"{recipe}_checkpoint", log_dir="/tmp",
        mlflow_run_id="", mlflow_run_url="", registered_model=recipe, model_version=version,
    )
    write_manifest(manifest)
    return manifest


def test_every_reference_form_resolves_to_the_registered_checkpoint(project_state):
    old = _manifest("sft-aaaa-000010", version="1")
    new = _manifest("sft-bbbb-000020", version="2", step=20)
    _manifest("dpo-cccc-000005", recipe="dpo", version="1", step=5)
    assert resolve_init_from("") is None
    assert resolve_init_from("latest:sft").manifest == new
    assert resolve_init_from("sft-aaaa-000010").manifest == old
    assert resolve_init_from(old.state_path).manifest == old
    assert resolve_init_from("sft/2").manifest == new
    assert resolve_init_from("best:sft", alias_lookup=lambda model, alias: "sft-aaaa-000010").manifest == old
    raw = resolve_init_from("tinker://elsewhere/weights/000001")
    assert raw.manifest is None and raw.state_path == "tinker://elsewhere/weights/000001"


def test_unresolvable_or_incompatible_references_say_what_to_pass(project_state):
    _manifest("sft-aaaa-000010", base="other-model")
    with pytest.raises(InitFromError, match="no rl checkpoint is registered yet; run the rl training job first"):
        resolve_init_from("latest:rl")
    with pytest.raises(InitFromError, match="names no checkpoint: use a tinker:// state path"):
        resolve_init_from("sft-nope")
    with pytest.raises(InitFromError, match="is sampler weights"):
        resolve_init_from("tinker://elsewhere/sampler_weights/000001")
    with pytest.raises(InitFromError, match="is a checkpoint of 'other-model', but this run trains 'm'"):
        resolve_init_from("sft-aaaa-000010", base_model="m")
    with pytest.raises(InitFromError, match="has no alias"):
        def missing(model, alias):
            raise LookupError(f"registered model {model!r} has no alias {alias!r}")
        resolve_init_from("best:sft", alias_lookup=missing)


def test_a_sampler_reference_resolves_to_sampler_weights_or_the_base_model(project_state):
    from assets.chaining import resolve_sampler

    registered = _manifest("sft-aaaa-000010", base="m")
    assert resolve_sampler("", base_model="m", what="sampler") == SamplerModel("m", None, None)
    by_key = resolve_sampler("latest:sft", base_model="m", what="sampler")
    assert by_key.sampler_path == registered.sampler_path and by_key.partition == registered.partition
    assert resolve_sampler(registered.sampler_path, base_model="m", what="sampler").manifest == registered
    raw = resolve_sampler("tinker://elsewhere/sampler_weights/000001", base_model="m", what="sampler")
    assert raw == SamplerModel("m", "tinker://elsewhere/sampler_weights/000001", None)
    with pytest.raises(InitFromError, match="teacher: init_from='sft-aaaa-000010' is a checkpoint of 'm', but this run trains 'other'"):
        resolve_sampler("sft-aaaa-000010", base_model="other", what="teacher")
    other_base = resolve_sampler("sft-aaaa-000010", base_model="other", what="teacher", same_base_model=False)
    assert other_base.base_model == "m"  # a teacher may be another model; its tokenizer is checked by the recipe
    with pytest.raises(InitFromError, match="unregistered training state without sampler weights"):
        resolve_sampler("tinker://elsewhere/weights/000001", base_model="m", what="sampler")
