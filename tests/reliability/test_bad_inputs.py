"""The bad-input matrix: every case fails with an error that names the input and the fix, and leaves nothing behind.

Four families, each one parametrized table:
- data assets (``chat_dataset``, ``rendered_tokens``, ``rl_problems``, ``preference_comparisons``) run on a real
  sqlite Dagster instance with the parquet IO manager;
- recipe configs (``sft_checkpoint``, ``rl_checkpoint``) and the Tinker resource config, same instance;
- the server API through the real tinker SDK against a localtinker with a small request-size limit;
- resuming a run with a changed schedule (the training core on that server).

"Nothing left behind" is checked the same way for every Dagster case (:func:`footprint`): no new
materialization or check evaluation of any asset, no new dynamic partition, no manifest, no parquet file
written or rewritten, no ``checkpoints.jsonl`` record. For API cases: the trainer's weights are unchanged
(same logprobs) and no file appears in the server's checkpoint storage.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tinker
from tinker import types

from assets.checkpoint_manifest import CheckpointManifest, write_manifest
from localtinker.protocol.app import ProtocolConfig
from localtinker.server import RunningServer, start_server
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from resources.tinker import TinkerResource
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources

REQUEST_LIMIT_BYTES = 200_000  # the API server's body limit, small so an oversized request is cheap to build
PROBE = [7, 70, 700, 7000, 17]  # a sequence whose logprobs show whether a failed call touched the weights
OTHER_MODEL_PARTITION = "dpo-0ther0ba-000002"  # a planted checkpoint of another base model (init_from case)


# ---------------------------------------------------------------------------------------------------------
# Dagster side: one instance with good data already materialized; every case must leave it as it was.


@dataclass
class Platform:
    state: Path
    files: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions

    def assets(self) -> list:
        return [a for a in self.defs.assets if isinstance(a, dg.AssetsDefinition)]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from pipelines.definitions import build_definitions
    from resources.tinker import EMBEDDED_SERVERS

    root = tmp_path_factory.mktemp("bad_inputs")
    state = root / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            good = {"chat_dataset": {"config": {"limit": 24, "heldout_fraction": 0.25}}}
            assert defs.resolve_job_def("sft_data").execute_in_process(instance=instance, run_config={"ops": good}).success
            problems = {"rl_problems": {"config": {"limit": 16, "heldout_fraction": 0.25}}}
            assert defs.resolve_job_def("rl_data").execute_in_process(instance=instance, run_config={"ops": problems}).success
            write_manifest(_other_model_manifest())
            files = root / "files"
            files.mkdir()
            try:
                yield Platform(state, files, instance, defs)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _other_model_manifest() -> CheckpointManifest:
    return CheckpointManifest(
        partition=OTHER_MODEL_PARTITION, recipe="dpo", name="000002", step=2, epoch=None, final=True,
        state_path="tinker://0ther0ba:train:0/weights/000002", sampler_path="tinker://0ther0ba:train:0/sampler_weights/000002",
        base_model="other-org/other-model", base_model_digest="0" * 64, renderer="chatml", training_dagster_run_id="0ther0ba",
        training_asset="dpo_checkpoint", log_dir="/nonexistent", mlflow_run_id="", mlflow_run_url="", registered_model="dpo",
        model_version="1",
    )


def footprint(platform: Platform) -> dict[str, Any]:
    """Everything a failing run could leave behind, as comparable values."""
    instance = platform.instance
    keys = sorted(instance.get_asset_keys(), key=lambda key: key.to_user_string())
    return {
        "materializations": {  # a key a failed run only planned has none: the same as absent
            key.to_user_string(): ids
            for key in keys
            if (ids := [r.storage_id for r in instance.fetch_materializations(key, limit=1000).records])
        },
        "partitions": {name: sorted(instance.get_dynamic_partitions(name)) for name in ("sft_checkpoints", "rl_checkpoints")},
        "manifests": sorted(path.name for path in (platform.state / "checkpoints").glob("*.json")),
        "parquet": {str(p.relative_to(platform.state)): p.stat().st_mtime_ns for p in platform.state.rglob("*.parquet")},
        "checkpoint_logs": {str(p): p.read_text() for p in (platform.state / "training").rglob("checkpoints.jsonl")},
    }


def failure_text(run: Callable[[], dg.ExecuteInProcessResult]) -> str:
    """The user-facing error of a run that must fail: the Failure description, or the error with its causes.

    Config errors (a value outside a launchpad enum) are refused before the run starts; their message is the text.
    """
    try:
        result = run()
    except dg.DagsterInvalidConfigError as error:
        return str(error)
    assert not result.success, "the run succeeded on a bad input"
    texts = []
    for event in result.all_events:
        if event.is_step_failure:
            data = event.step_failure_data
            texts.append(data.user_failure_data.description if data.user_failure_data else "")
            texts.append(data.error.to_string() if data.error else "")
    return "\n".join(texts)


@dataclass(frozen=True)
class DagsterCase:
    id: str
    asset: str  # the asset whose materialization must fail
    config: dict[str, Any]
    match: str  # regex the error must contain: the input and the fix
    file: Callable[[Path], None] | None = None  # writes the bad input file into the given directory
    resources: dict[str, Any] = field(default_factory=dict)  # resource overrides (resource-config cases)


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        path = directory / name
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)

    return write


def _write_parquet(name: str, table: dict) -> Callable[[Path], None]:
    return lambda directory: pq.write_table(pa.table(table), directory / name)


def _lines(*rows: Any) -> str:
    return "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)


GOOD_CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
FILE = "{files}"  # replaced by the case's input file path

DATA_CASES = [
    DagsterCase("jsonl_malformed_line", "chat_dataset", {"source": f"{FILE}/broken.jsonl"},
                r"broken\.jsonl line 2: malformed JSON", _write("broken.jsonl", _lines(GOOD_CHAT, "{not json"))),
    DagsterCase("jsonl_content_not_string", "chat_dataset", {"source": f"{FILE}/int.jsonl"},
                r"int\.jsonl line 1 message 0: user message content is int, expected a string",
                _write("int.jsonl", _lines({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}))),
    DagsterCase("jsonl_unknown_role", "chat_dataset", {"source": f"{FILE}/role.jsonl"},
                r"role\.jsonl line 1 message 0: unknown role 'wizard' \(expected one of assistant",
                _write("role.jsonl", _lines({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}))),
    DagsterCase("jsonl_no_assistant_turn", "chat_dataset", {"source": f"{FILE}/user_only.jsonl"},
                r"user_only\.jsonl line 1: conversation has no assistant message",
                _write("user_only.jsonl", _lines({"messages": [{"role": "user", "content": "hi"}]}))),
    DagsterCase("jsonl_empty_file", "chat_dataset", {"source": f"{FILE}/empty.jsonl"},
                r"empty\.jsonl: no usable chat rows .*check the split, the column mapping and the file", _write("empty.jsonl", "")),
    DagsterCase("parquet_wrong_schema", "chat_dataset", {"source": f"{FILE}/wrong.parquet"},
                r"wrong\.parquet row 0: missing column 'messages' \(columns present: \['text'\]\)",
                _write_parquet("wrong.parquet", {"text": ["a", "b"]})),
    DagsterCase("parquet_mapping_to_missing_column", "chat_dataset",
                {"source": f"{FILE}/mapped.parquet", "columns": {"messages": "conversation"}},
                r"missing column 'conversation' \(columns present: \['text'\]\)", _write_parquet("mapped.parquet", {"text": ["a"]})),
    DagsterCase("parquet_corrupt_file", "chat_dataset", {"source": f"{FILE}/corrupt.parquet"},
                r"corrupt\.parquet: .*not a parquet file", _write("corrupt.parquet", b"PAR1 this is not a parquet file")),
    DagsterCase("source_file_missing", "chat_dataset", {"source": f"{FILE}/absent.jsonl"},
                r"absent\.jsonl: no such file or directory"),
    DagsterCase("source_unknown_dataset_offline", "chat_dataset", {"source": "no-such-org/no-such-dataset"},
                r"no-such-org/no-such-dataset: not in the local datasets cache, and offline mode .*go online .*"
                r"POSTTRAIN_HUB_MIRROR/no-such-org/no-such-dataset, or pass a local \.jsonl / \.parquet file"),
    DagsterCase("rl_problems_without_answer", "rl_problems", {"source": f"{FILE}/no_answer.jsonl"},
                r"no_answer\.jsonl line 1: .*answer", _write("no_answer.jsonl", _lines({"question": "What is 1 + 1?"}))),
    DagsterCase("comparison_without_rejected", "preference_comparisons", {"source": f"{FILE}/half_pair.jsonl"},
                r"half_pair\.jsonl line 1: .*rejected", _write("half_pair.jsonl", _lines({"prompt": "q", "chosen": "a"}))),
    DagsterCase("unknown_renderer", "rendered_tokens", {"renderer": "nope"},
                r"rendered_tokens: unknown renderer 'nope'; known renderers: chat_template, chatml"),
    DagsterCase("unknown_train_on_what", "rendered_tokens", {"train_on_what": "everything"},
                r"unknown train_on_what 'everything'; expected one of last_assistant_message"),
    DagsterCase("max_length_zero", "rendered_tokens", {"max_length": 0},
                r"max_length=0 leaves no token to train on .*set max_length >= 2, or null"),
]

SFT_BASE = {"batch_size": 4, "max_steps": 2, "save_every": 0, "lora_rank": 4}
RL_BASE = {"init_from": "", "max_steps": 1, "group_size": 2, "groups_per_batch": 2, "max_tokens": 4, "lora_rank": 4}

CONFIG_CASES = [
    DagsterCase("adam_eps_zero", "sft_checkpoint", {**SFT_BASE, "adam": {"eps": 0.0}}, r"adam\.eps must be positive, got 0\.0"),
    DagsterCase("adam_beta1_above_one", "sft_checkpoint", {**SFT_BASE, "adam": {"beta1": 1.5}}, r"adam\.beta1 must be in \[0, 1\), got 1\.5"),
    DagsterCase("negative_learning_rate", "sft_checkpoint", {**SFT_BASE, "learning_rate": -1e-4},
                r"learning_rate must be positive, got -0\.0001"),
    DagsterCase("zero_lora_rank", "sft_checkpoint", {**SFT_BASE, "lora_rank": 0}, r"lora_rank must be positive, got 0"),
    DagsterCase("zero_batch_size", "sft_checkpoint", {**SFT_BASE, "batch_size": 0}, r"batch_size must be positive, got 0"),
    DagsterCase("batch_larger_than_data", "sft_checkpoint", {**SFT_BASE, "batch_size": 1000},
                r"make no complete batch of batch_size=1000: add examples or lower batch_size"),
    DagsterCase("warmup_not_below_steps", "sft_checkpoint", {**SFT_BASE, "warmup_steps": 2},
                r"warmup_steps=2 must be smaller than the 2 planned steps"),
    DagsterCase("unknown_lr_schedule", "sft_checkpoint", {**SFT_BASE, "lr_schedule": "exponential"},
                r"sft_checkpoint:config:lr_schedule not in enum type Literal\['linear', 'cosine', 'constant'\] got exponential"),
    DagsterCase("init_from_unknown_partition", "sft_checkpoint", {**SFT_BASE, "init_from": "sft-deadbeef-000004"},
                r"init_from='sft-deadbeef-000004' names no checkpoint: use a tinker:// state path, a checkpoint partition key"),
    DagsterCase("init_from_sampler_weights", "sft_checkpoint",
                {**SFT_BASE, "init_from": "tinker://somerun:train:0/sampler_weights/000002"},
                r"is sampler weights \(no optimizer-compatible state\): pass the tinker://\.\.\./weights/<name> state path"),
    DagsterCase("init_from_other_base_model", "sft_checkpoint", {**SFT_BASE, "init_from": OTHER_MODEL_PARTITION},
                r"is a checkpoint of 'other-org/other-model', but this run trains 'localtinker/tiny-random': materialize base_model"),
    DagsterCase("rl_unknown_env", "rl_checkpoint", {**RL_BASE, "env": "no_such_env"},
                r"rl_checkpoint: cannot build env='no_such_env'.*unknown RL env 'no_such_env'.*take env='problems' only"),
    DagsterCase("rl_unknown_renderer", "rl_checkpoint", {**RL_BASE, "renderer": "nope"}, r"unknown renderer 'nope'; known renderers"),
    DagsterCase("rl_unknown_loss", "rl_checkpoint", {**RL_BASE, "loss_fn": "reinforce++"},
                r"rl_checkpoint:config:loss_fn not in enum type Literal\['importance_sampling', 'ppo', .*\] got reinforce\+\+"),
    DagsterCase("rl_dro_without_beta", "rl_checkpoint", {**RL_BASE, "loss_fn": "dro"},
                r"rl_checkpoint config is invalid: loss_fn 'dro' needs loss_fn_config=\{'beta': <float>\}"),
    DagsterCase("rl_parent_not_trained_yet", "rl_checkpoint", {**RL_BASE, "init_from": "latest:sft"},
                r"init_from='latest:sft': no sft checkpoint is registered yet; run the sft training job first"),
    DagsterCase("resource_unknown_backend", "base_model", {}, r"TinkerResource\.backend='hosted' is not one of .*fix the resource config",
                resources={"tinker": TinkerResource(backend="hosted", base_model=TINY_MODEL)}),
    DagsterCase("resource_remote_without_key", "base_model", {}, r"backend='remote' needs an API key: export TINKER_API_KEY",
                resources={"tinker": TinkerResource(backend="remote", base_model=TINY_MODEL)}),
]


@pytest.mark.parametrize("case", DATA_CASES + CONFIG_CASES, ids=lambda case: case.id)
def test_bad_dagster_input_fails_clearly_and_leaves_nothing_behind(platform: Platform, case: DagsterCase) -> None:
    directory = Path(tempfile.mkdtemp(dir=platform.files))
    if case.file is not None:
        case.file(directory)
    config = json.loads(json.dumps(case.config).replace(FILE, str(directory)))
    before = footprint(platform)
    text = failure_text(
        lambda: dg.materialize(
            platform.assets(),
            selection=[case.asset],
            instance=platform.instance,
            resources={**tiny_resources(platform.state), **case.resources},
            run_config={"ops": {case.asset: {"config": config}}},
            raise_on_error=False,
        )
    )
    assert re.search(case.match, text, re.DOTALL), f"{case.id}: the error does not say what is wrong and how to fix it:\n{text[:2000]}"
    assert footprint(platform) == before


# ---------------------------------------------------------------------------------------------------------
# Server API: the real SDK against a localtinker with a small body limit.


@dataclass
class Api:
    server: RunningServer
    client: tinker.ServiceClient
    trainer: tinker.TrainingClient
    sampler: tinker.SamplingClient
    sampler_path: str
    vocab: int
    probe: np.ndarray

    def probe_logprobs(self) -> np.ndarray:
        # A timeout well under the server's gap timeout: a refused request must not hold up the next one.
        forward = self.trainer.forward([_datum(PROBE)], "cross_entropy").result(timeout=30)
        return forward.loss_fn_outputs[0]["logprobs"].to_numpy()

    def stored_files(self) -> list[str]:
        return sorted(str(p.relative_to(self.server.storage_dir)) for p in Path(self.server.storage_dir).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    config = ProtocolConfig(max_request_bytes=REQUEST_LIMIT_BYTES)
    with start_server(tmp_path_factory.mktemp("api-storage"), dtype="float32", config=config) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=3).result()
        sampler_path = trainer.save_weights_for_sampler("probe").result().path
        handle = Api(server, client, trainer, client.create_sampling_client(model_path=sampler_path).result(), sampler_path,
                     len(trainer.get_tokenizer()), np.empty(0))
        handle.probe = handle.probe_logprobs()
        yield handle
        client.close("success").result(timeout=60)


def _datum(tokens: list[int], **inputs: Any) -> types.Datum:
    loss_inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1), **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


def _rl_datum(**overrides: Any) -> types.Datum:
    inputs = {"target_tokens": [2, 3], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0], **overrides}
    return types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs=inputs)


def _sample(api: Api, prompt: list[int] | None = None, num_samples: int = 1, **params: Any) -> Any:
    sampling = types.SamplingParams(max_tokens=2, **params)
    return api.sampler.sample(types.ModelInput.from_ints(prompt or [1, 2]), num_samples, sampling).result()


@dataclass(frozen=True)
class ApiCase:
    id: str
    call: Callable[[Api], Any]
    match: str


API_CASES = [
    ApiCase("out_of_vocab_target", lambda a: a.trainer.forward_backward([_datum([1, 2, a.vocab + 10])], "cross_entropy").result(),
            r"49162"),
    ApiCase("target_tokens_shorter_than_input",
            lambda a: a.trainer.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                                              loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0, 1.0]})],
                                                 "cross_entropy").result(),
            r"target_tokens'\] has shape \[2\] but model_input has 3 tokens; per-token inputs need one entry per input token"),
    ApiCase("weights_shorter_than_input", lambda a: a.trainer.forward_backward([_datum([1, 2, 3, 4], weights=[1.0])], "cross_entropy").result(),
            r"weights'\] has shape \[1\] but model_input has 3 tokens"),
    ApiCase("empty_model_input", lambda a: a.trainer.forward_backward([_datum([1], target_tokens=[], weights=[])], "cross_entropy").result(),
            r"model_input is empty; every Datum needs at least one token"),
    ApiCase("nan_weights", lambda a: a.trainer.forward_backward([_datum([1, 2, 3], weights=[float("nan"), 1.0])], "cross_entropy").result(),
            r"weights'\] contains NaN or infinite values"),
    ApiCase("sequence_longer_than_context",
            lambda a: a.trainer.forward_backward([_datum(list(range(1, 3000)))], "cross_entropy").result(),
            r"model_input has 2998 tokens, more than the model's context of 2048; truncate or split"),
    ApiCase("oversized_request", lambda a: a.trainer.forward_backward([_datum([5] * 60_000)], "cross_entropy").result(),
            rf"request body exceeds the {REQUEST_LIMIT_BYTES}-byte limit; send smaller requests"),
    ApiCase("unknown_loss", lambda a: a.trainer.forward_backward([_datum(PROBE)], "stable_reinforce").result(),
            r"stable_reinforce.*Supported losses: cross_entropy"),
    ApiCase("rl_loss_without_logprobs", lambda a: a.trainer.forward_backward([_datum([1, 2, 3])], "importance_sampling").result(),
            r"loss_fn_inputs\['logprobs'\] is missing; loss 'importance_sampling' needs it for every token"),
    ApiCase("ppo_unknown_config_key", lambda a: a.trainer.forward_backward([_rl_datum()], "ppo", loss_fn_config={"clip_bogus": 1.0}).result(),
            r"loss_fn_config keys \['clip_bogus'\] are not used by 'ppo' \(accepted: clip_low_threshold, clip_high_threshold\)"),
    ApiCase("dro_without_beta", lambda a: a.trainer.forward_backward([_rl_datum()], "dro").result(),
            r"loss 'dro' needs loss_fn_config\['beta'\]"),
    ApiCase("adam_eps_zero", lambda a: a.trainer.optim_step(types.AdamParams(eps=0.0)).result(),
            r"AdamParams\.eps must be finite and > 0 .*got 0\.0"),
    ApiCase("adam_beta1_above_one", lambda a: a.trainer.optim_step(types.AdamParams(beta1=1.5)).result(),
            r"AdamParams\.beta1 must be finite and in \[0, 1\), got 1\.5"),
    ApiCase("adam_negative_lr", lambda a: a.trainer.optim_step(types.AdamParams(learning_rate=-0.1)).result(),
            r"AdamParams\.learning_rate must be finite and >= 0, got -0\.1"),
    ApiCase("adam_nan_learning_rate", lambda a: a.trainer.optim_step(types.AdamParams(learning_rate=float("nan"))).result(),
            r"learning_rate is null \(a NaN on the client is sent as null\); pass finite numbers"),
    ApiCase("adam_negative_weight_decay", lambda a: a.trainer.optim_step(types.AdamParams(weight_decay=-1.0)).result(),
            r"AdamParams\.weight_decay must be finite and >= 0, got -1\.0"),
    ApiCase("checkpoint_ttl_too_short", lambda a: a.trainer.save_state("short-lived", ttl_seconds=60).result(),
            r"ttl_seconds=60 must be .* between 3600"),
    ApiCase("unknown_base_model", lambda a: a.client.create_lora_training_client(base_model="no-such/model", rank=4).result(),
            r"base model 'no-such/model' could not be loaded .*Use 'HuggingFaceTB/SmolLM2-135M-Instruct'"),
    ApiCase("lora_rank_zero", lambda a: a.client.create_lora_training_client(base_model=TINY_MODEL, rank=0).result(),
            r"lora_config\.rank=0 must be between 1 and 1024"),
    ApiCase("state_path_missing", lambda a: a.client.create_training_client_from_state("tinker://nowhere/weights/missing").result(),
            r"tinker://nowhere/weights/missing does not exist; list_checkpoints shows the saved ones"),
    ApiCase("state_path_malformed", lambda a: a.client.create_training_client_from_state("tinker://nonsense").result(),
            r"'tinker://nonsense' must look like tinker://<run_id>/weights/<name>"),
    ApiCase("sampler_weights_as_optimizer_state",
            lambda a: a.client.create_training_client_from_state_with_optimizer(a.sampler_path).result(),
            r"holds no optimizer state \(sampler weights\); restore from a tinker://\.\.\./weights/\.\.\. path"),
    ApiCase("sampling_top_p_above_one", lambda a: _sample(a, top_p=1.5), r"top_p=1\.5 must be in \(0, 1\]"),
    ApiCase("sampling_negative_temperature", lambda a: _sample(a, temperature=-1.0), r"temperature=-1\.0 must be >= 0"),
    ApiCase("sampling_stop_token_out_of_vocab", lambda a: _sample(a, stop=[a.vocab + 5]),
            r"stop token id 49157 is outside the vocabulary \[0, 49152\)"),
    ApiCase("sampling_prompt_out_of_vocab", lambda a: _sample(a, prompt=[1, a.vocab + 3]),
            r"prompt token 49155 \(position 1\) is outside the vocabulary \[0, 49152\); tokenize with this model's tokenizer"),
    ApiCase("sampling_zero_samples", lambda a: _sample(a, num_samples=0), r"num_samples=0 must be between 1 and 256"),
]


@pytest.mark.parametrize("case", API_CASES, ids=lambda case: case.id)
def test_bad_api_request_fails_clearly_and_changes_nothing(api: Api, case: ApiCase) -> None:
    files = api.stored_files()
    with pytest.raises(tinker.TinkerError) as failed:
        case.call(api)
    assert re.search(case.match, str(failed.value), re.DOTALL), f"{case.id}: {failed.value}"
    np.testing.assert_array_equal(api.probe_logprobs(), api.probe)  # no weight or gradient was touched
    assert api.stored_files() == files  # no checkpoint, half-written or otherwise


def test_a_wrong_api_key_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with start_server(tmp_path / "storage", dtype="float32", api_key="tml-the-right-key") as server:
        with pytest.raises(tinker.AuthenticationError, match=r"X-API-Key header is wrong; set TINKER_API_KEY to the server's --api-key"):
            tinker.ServiceClient(base_url=server.base_url, api_key="tml-a-wrong-key").create_lora_training_client(
                base_model=TINY_MODEL, rank=4
            ).result()
        assert not list(Path(server.storage_dir).rglob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------------
# Resuming a run whose schedule changed: the core refuses, and the run's checkpoint log is untouched.


@pytest.mark.parametrize(
    "change, match",
    [
        ({"learning_rate": 2e-3}, r"learning_rate: 0\.001 -> 0\.002"),
        ({"lr_schedule": "cosine"}, r"lr_schedule: 'linear' -> 'cosine'"),
        ({"max_steps": 3}, r"total_steps: 2 -> 3"),
    ],
    ids=["learning_rate", "lr_schedule", "max_steps"],
)
def test_resume_with_a_changed_schedule_is_refused(platform: Platform, api: Api, tmp_path_factory, change, match) -> None:
    from posttrain.supervised.config import SupervisedConfig
    from posttrain.supervised.data import RenderedTokens
    from posttrain.supervised.recipe import SupervisedRecipe
    from posttrain.training.core import ResumeMismatchError, train

    tokens = RenderedTokens(pq.read_table(platform.state / "parquet" / "rendered_tokens.parquet"), split="train")
    log_dir = _trained_log_dir(tmp_path_factory, api, tokens)
    before = (log_dir / "checkpoints.jsonl").read_text()
    training = {"base_model": TINY_MODEL, "lora_rank": 4, "learning_rate": 1e-3, "max_steps": 2, "save_every": 1,
                "log_dir": str(log_dir), **change}
    config = SupervisedConfig.from_dict({"batch_size": 4, "training": training})
    with pytest.raises(ResumeMismatchError, match=match) as refused:
        train(config.training, SupervisedRecipe(config, tokens), api.client)
    assert "resume with the same settings, or start a new run" in str(refused.value)
    assert (log_dir / "checkpoints.jsonl").read_text() == before


_TRAINED: dict[str, Path] = {}


def _trained_log_dir(tmp_path_factory, api: Api, tokens) -> Path:
    """A copy of one finished 2-step run's log dir (trained once per module)."""
    import shutil

    from posttrain.supervised.config import SupervisedConfig
    from posttrain.supervised.recipe import SupervisedRecipe
    from posttrain.training.core import train

    if "run" not in _TRAINED:
        log_dir = tmp_path_factory.mktemp("resume-source")
        training = {"base_model": TINY_MODEL, "lora_rank": 4, "learning_rate": 1e-3, "max_steps": 2, "save_every": 1, "log_dir": str(log_dir)}
        config = SupervisedConfig.from_dict({"batch_size": 4, "training": training})
        result = train(config.training, SupervisedRecipe(config, tokens), api.client)
        assert [record.batch for record in result.checkpoints] == [1, 2]
        _TRAINED["run"] = log_dir
    copy = tmp_path_factory.mktemp("resume")
    shutil.copytree(_TRAINED["run"], copy, dirs_exist_ok=True)
    return copy
