"""save_state / load_state (with and without Adam moments), sampler weights, listing, deletion, restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, EngineUserError, LoraSpec, SampleSpec, UnknownModelError
from localtinker.engine.engine import LocalEngine
from tinker.types.checkpoint import ParsedCheckpointTinkerPath
from tests.localtinker.engine.reference import TINY, sft_datum

ADAM = AdamSpec(learning_rate=0.02, weight_decay=0.01)


def train_steps(engine, model_id: str, seeds) -> list[dict]:
    metrics = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        engine.forward_backward(model_id, [sft_datum(rng, 10), sft_datum(rng, 6)], "cross_entropy", None, False)
        metrics.append(engine.optim_step(model_id, ADAM))
    return metrics


def test_restore_with_optimizer_continues_exactly_across_a_restart(engine, engine_storage, new_id):
    spec = LoraSpec(rank=4, seed=21)
    straight = new_id()
    engine.create_model(straight, TINY, spec)
    train_steps(engine, straight, [1, 2, 3, 4])

    interrupted = new_id()
    engine.create_model(interrupted, TINY, spec)
    train_steps(engine, interrupted, [1, 2])
    path = engine.save_state(interrupted, "step-2")
    parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    assert parsed.training_run_id == interrupted and parsed.checkpoint_type == "training"

    restarted = LocalEngine(engine_storage, dtype="float32")  # a new server process on the same storage
    resumed = new_id()
    info = restarted.load_state(resumed, path, with_optimizer=True, base_model=None)
    assert info.base_model == TINY and info.lora_rank == 4
    metrics = train_steps(restarted, resumed, [3, 4])
    assert metrics[-1]["step"] == 4.0
    expected = engine.lora_weights(straight)

    def close_to_expected(weights: dict) -> bool:
        # To float32 rounding: oneDNN's sum order follows buffer alignment, which differs run to run, and Adam's
        # m/√v turns a rounding difference in a near-zero moment into up to ~1e-5 of the weights' scale.
        return all((value - expected[key]).abs().max().item() <= 1e-4 * expected[key].abs().max().item() for key, value in weights.items())

    assert close_to_expected(restarted.lora_weights(resumed))

    fresh = new_id()
    restarted.load_state(fresh, path, with_optimizer=False, base_model=None)
    saved = engine.lora_weights(interrupted)
    assert all(torch.equal(v, saved[k]) for k, v in restarted.lora_weights(fresh).items())
    metrics = train_steps(restarted, fresh, [3, 4])
    assert metrics[-1]["step"] == 2.0  # moments and step were reset
    diverged = restarted.lora_weights(fresh)
    assert any(not torch.allclose(diverged[k], expected[k], atol=1e-6) for k in expected)
    assert not close_to_expected(diverged)  # the tolerance above still tells a reset optimizer from a restored one


def test_load_state_restores_weights_without_optimizer(engine, new_id):
    source = new_id()
    engine.create_model(source, TINY, LoraSpec(rank=4, seed=3, train_attn=False))
    train_steps(engine, source, [5])
    path = engine.save_state(source, "w")
    copy = new_id()
    engine.load_state(copy, path, with_optimizer=False, base_model=None)
    assert engine.lora_spec(copy) == engine.lora_spec(source)
    original = engine.lora_weights(source)
    assert all(torch.equal(v, original[k]) for k, v in engine.lora_weights(copy).items())


def test_sampler_weights_round_trip_and_listing(engine, new_id):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=9))
    train_steps(engine, model_id, [7])
    sampler_path = engine.save_sampler_weights(model_id, "s1")
    state_path = engine.save_state(model_id, "s1")
    assert sampler_path == f"tinker://{model_id}/sampler_weights/s1"
    assert state_path == f"tinker://{model_id}/weights/s1"
    listed = {info.tinker_path: info for info in engine.list_checkpoints(model_id)}
    assert set(listed) == {sampler_path, state_path}
    assert listed[state_path].size_bytes > listed[sampler_path].size_bytes > 0  # state also holds Adam moments
    with pytest.raises(EngineUserError, match="no optimizer state"):
        engine.load_state(new_id(), sampler_path, with_optimizer=True, base_model=None)

    prompt = SampleSpec(prompt_tokens=(5, 6, 7, 8), max_tokens=4, seed=3)
    assert engine.create_sampler("ckpt-sampler", None, sampler_path) == TINY
    engine.create_ephemeral_sampler("live-sampler", model_id)
    from_disk, live = engine.sample_batch([("ckpt-sampler", prompt), ("live-sampler", prompt)])
    assert from_disk.sequences[0].tokens == live.sequences[0].tokens
    np.testing.assert_allclose(from_disk.sequences[0].logprobs, live.sequences[0].logprobs, atol=1e-6)

    engine.delete_checkpoint(sampler_path)
    assert [info.tinker_path for info in engine.list_checkpoints(model_id)] == [state_path]
    with pytest.raises(UnknownModelError):
        engine.delete_checkpoint(sampler_path)
    with pytest.raises(UnknownModelError):
        engine.create_sampler("gone", None, sampler_path)


def test_ephemeral_sampler_is_a_snapshot(engine, new_id):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=9))
    train_steps(engine, model_id, [1])
    engine.create_ephemeral_sampler("snap-before", model_id)
    prompt = SampleSpec(prompt_tokens=(5, 6, 7), max_tokens=3, temperature=0.0)
    before = engine.sample_batch([("snap-before", prompt)])[0].sequences[0].logprobs
    train_steps(engine, model_id, [2, 3])
    again = engine.sample_batch([("snap-before", prompt)])[0].sequences[0].logprobs
    engine.create_ephemeral_sampler("snap-after", model_id)
    after = engine.sample_batch([("snap-after", prompt)])[0].sequences[0].logprobs
    assert before == again and before != after


def test_overwrite_is_atomic_and_bad_paths_are_rejected(engine, engine_storage, new_id):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=2, seed=0))
    engine.save_state(model_id, "same")
    train_steps(engine, model_id, [1])
    path = engine.save_state(model_id, "same")
    copy = new_id()
    engine.load_state(copy, path, with_optimizer=True, base_model=None)
    assert all(torch.equal(v, engine.lora_weights(model_id)[k]) for k, v in engine.lora_weights(copy).items())
    leftovers = [p for p in (engine_storage / "checkpoints").rglob(".*")]
    assert leftovers == []
    for bad in ("s3://x/weights/y", "tinker://run/other/y", "tinker://run/weights"):
        with pytest.raises(EngineUserError, match="tinker://"):
            engine.load_state(new_id(), bad, with_optimizer=False, base_model=None)
    with pytest.raises(UnknownModelError, match="does not exist"):
        engine.load_state(new_id(), "tinker://nobody:train:0/weights/none", with_optimizer=False, base_model=None)
    for bad_name in ("a/b", "", ".hidden"):
        with pytest.raises(EngineUserError, match="checkpoint name"):
            engine.save_state(model_id, bad_name)


def test_old_snapshots_are_dropped_with_a_clear_error(engine, engine_storage, new_id):
    from localtinker.engine.engine import SNAPSHOTS_PER_MODEL

    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=2, seed=0))
    for step in range(SNAPSHOTS_PER_MODEL + 1):
        train_steps(engine, model_id, [step])
        engine.create_ephemeral_sampler(f"{model_id}-snap{step}", model_id)
    prompt = SampleSpec(prompt_tokens=(1, 2), max_tokens=1)
    oldest, newest = engine.sample_batch([(f"{model_id}-snap0", prompt), (f"{model_id}-snap{SNAPSHOTS_PER_MODEL}", prompt)])
    assert isinstance(oldest, UnknownModelError) and "superseded" in str(oldest)
    assert len(newest.sequences[0].tokens) == 1


def test_a_checkpoint_overwritten_under_the_same_name_is_reloaded(engine, new_id):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=0))
    prompt = SampleSpec(prompt_tokens=(3, 4, 5), max_tokens=3, temperature=0.0, stop_token_ids=())
    train_steps(engine, model_id, [1])
    path = engine.save_sampler_weights(model_id, "latest")
    engine.create_sampler("latest-1", None, path)
    first = engine.sample_batch([("latest-1", prompt)])[0].sequences[0].logprobs
    train_steps(engine, model_id, [2, 3])
    assert engine.save_sampler_weights(model_id, "latest") == path
    engine.create_sampler("latest-2", None, path)
    engine.create_ephemeral_sampler("live", model_id)
    second, live = (r.sequences[0].logprobs for r in engine.sample_batch([("latest-2", prompt), ("live", prompt)]))
    assert second != first and np.allclose(second, live, atol=1e-6)


def test_checkpoint_ttl_expires_lists_and_deletes(tmp_path):
    """A checkpoint saved with ttl_seconds lists its expiry, can have it changed or removed, and once
    expired is deleted from disk, absent from listings and fails to load with a message saying so."""
    from localtinker.engine.checkpoints import CheckpointStore

    now = [1_000_000.0]
    store = CheckpointStore(tmp_path, clock=lambda: now[0])
    weights = {"w": torch.ones(2)}
    short = store.save("run:train:0", "weights", "short", weights, {"step": 1}, ttl_seconds=3600)
    keep = store.save("run:train:0", "sampler_weights", "keep", weights, {"step": 1})
    renewed = store.save("run:train:0", "weights", "renewed", weights, {"step": 1}, ttl_seconds=3600)
    assert {info.tinker_path: info.expires_at for info in store.list()} == {
        short: 1_003_600.0,
        keep: None,
        renewed: 1_003_600.0,
    }
    assert store.set_ttl(renewed, None).expires_at is None
    assert store.set_ttl(keep, 7200).expires_at == 1_007_200.0
    now[0] += 3600
    assert {info.tinker_path for info in store.list()} == {keep, renewed}
    assert not (tmp_path / "run%3Atrain%3A0" / "weights" / "short").exists()
    with pytest.raises(UnknownModelError, match="does not exist"):
        store.load(short)
    now[0] += 3600
    store.save("run:train:0", "weights", "later", weights, {"step": 2})  # saving purges expired ones too
    assert not (tmp_path / "run%3Atrain%3A0" / "sampler_weights" / "keep").exists()
    assert [info.name for info in store.list()] == ["renewed", "later"]
    for bad in (0, 3599, 10 * 365 * 24 * 3600 + 1, 1.5):
        with pytest.raises(EngineUserError, match="ttl_seconds"):
            store.save("run:train:0", "weights", "bad", weights, {"step": 1}, ttl_seconds=bad)


def test_loading_an_expired_checkpoint_says_it_expired(tmp_path):
    from localtinker.engine.checkpoints import CheckpointStore

    now = [50_000.0]
    store = CheckpointStore(tmp_path, clock=lambda: now[0])
    path = store.save("run:train:1", "weights", "old", {"w": torch.ones(1)}, {"step": 1}, ttl_seconds=3600)
    now[0] += 3601
    with pytest.raises(UnknownModelError, match="expired at .* and was deleted"):
        store.load(path)
    assert store.list() == []


def test_saves_scan_the_directory_only_when_a_checkpoint_may_have_expired(tmp_path, monkeypatch):
    """An RL loop saves a sampler checkpoint per step: a save reads the other checkpoints' metas only at
    start-up and once a known expiry has passed, and a restarted store still purges what an earlier
    process saved with a TTL."""
    from localtinker.engine.checkpoints import CheckpointStore

    now = [1_000_000.0]
    weights = {"w": torch.ones(2)}
    earlier = CheckpointStore(tmp_path, clock=lambda: now[0])
    old = earlier.save("run:train:0", "sampler_weights", "old", weights, {"step": 0}, ttl_seconds=3600)

    store = CheckpointStore(tmp_path, clock=lambda: now[0])  # a restart
    scans = []
    scan = store._scan
    monkeypatch.setattr(store, "_scan", lambda run_id: scans.append(run_id) or scan(run_id))
    for step in range(20):
        store.save("run:train:0", "sampler_weights", f"s{step}", weights, {"step": step})
    assert len(scans) == 1
    now[0] += 3600
    store.save("run:train:0", "sampler_weights", "s20", weights, {"step": 20})
    assert len(scans) == 2
    assert old not in {info.tinker_path for info in store.list()}
    short = store.save("run:train:0", "weights", "short", weights, {"step": 21}, ttl_seconds=3600)
    store.save("run:train:0", "sampler_weights", "s21", weights, {"step": 21})
    assert len(scans) == 3  # list() scans; this save did not
    now[0] += 3600
    store.save("run:train:0", "sampler_weights", "s22", weights, {"step": 22})
    assert len(scans) == 4 and not (tmp_path / "run%3Atrain%3A0" / "weights" / "short").exists()
    with pytest.raises(UnknownModelError):
        store.load(short)
