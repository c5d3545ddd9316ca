"""DPO on the platform: on-policy pairs from a checkpoint, reference logprobs computed once, DPO checkpoints.

- ``onpolicy_comparisons``: a checkpoint (default ``latest:sft``) answers each ``rl_problems`` prompt
  ``group_size`` times; the problems' own scorers grade the answers; a prompt with a correct and an
  incorrect answer becomes one comparison (``posttrain.preference.onpolicy``). The split column is the
  problem's (by prompt hash), so held-out prompts give held-out pairs for the eval report. ``accumulate``
  appends them to the table's latest version instead (iterated RLHF: each judge round sees every policy).
- ``onpolicy_pairs``: those comparisons rendered exactly like ``preference_pairs`` (one factory).
- ``reference_logprobs``: the reference model's logprobs of every pair of one pairs table, keyed by
  (pairs data version, reference): its data version is a hash of both, and a re-run with the same
  inputs returns the stored table ("cached") instead of scoring again.
- ``dpo_checkpoint``: ``posttrain.preference.DpoRecipe`` on the train split of the pairs table chosen in
  the launchpad (``pairs``: on-policy or offline/hub). Its reference is the run's starting weights (or
  ``reference_model``); when the latest ``reference_logprobs`` was computed for exactly this pairs
  version and this reference, training reads it (a β sweep never rescores), otherwise the recipe
  computes its own and the log says why. Each manifest records the reference and the pairs' sampler
  checkpoint (``related``), so ``python -m pipelines lineage`` walks DPO → pairs → SFT → data → base.
- ``dpo_eval_report``: on the held-out pairs of the exact pairs version trained on (on-policy or offline),
  pair accuracy, reward margin and DPO loss under the run's implicit reward β·(lp − lp_ref) (against the
  reference logprobs the run trained with, or its recorded reference model); ``best`` follows pair accuracy.
- ``dpo_offline_chain`` (``pipelines``): offline comparisons (HH-RLHF, UltraFeedback, a file) → pairs →
  reference logprobs (base model) → DPO from the base model, in one run.
"""

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Literal

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from assets.base_model import BASE_MODEL_KEY
from assets.chaining import InitFromError, ParentCheckpoint, resolve_sampler
from assets.checkpoint_manifest import CheckpointManifest, read_manifest
from assets.datasets import (
    DATA_GROUP,
    blocking,
    checked_table_output,
    data_errors,
    failures_check,
    messages_preview,
    schema_check,
    table_output,
)
from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.outputs import versioned_output
from assets.preferences import build_pairs_asset, identical_failures
from assets.problems import PROBLEMS_ASSET
from assets.training import (
    RecipeInputs,
    RecipeRun,
    TrainingSpec,
    build_checkpoints_asset,
    build_training_asset,
    check_choice_is_fresh,
)
from assets.upstream import (
    VERSION_PATH_KEY,
    UpstreamVersion,
    inputs_of,
    latest_version,
    read_versioned_table,
    unread_inputs_metadata,
)
from posttrain.atomic_files import staged
from posttrain.datasets import schemas
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.eval.accuracy import default_grade
from posttrain.preference import (
    REFERENCE_LOGPROBS,
    DpoConfig,
    DpoRecipe,
    PairAccuracyEvaluator,
    PreferencePairs,
    accumulate_comparisons,
    build_onpolicy_pairs,
    compute_reference_logprobs,
    pairs_from_table,
    reference_sampling_client,
    samplers_in,
)
from posttrain.renderers import get_renderer
from resources.mlflow import MlflowResource
from resources.models import load_tokenizer
from resources.state import state_subdir
from resources.tinker import TinkerResource

COMPARISONS_ASSET = "onpolicy_comparisons"
ONPOLICY_PAIRS = "onpolicy_pairs"
OFFLINE_PAIRS = "preference_pairs"
PAIR_ASSETS = (ONPOLICY_PAIRS, OFFLINE_PAIRS)  # the launchpad's `pairs` choice; the first is the default
REFERENCE_ASSET = "reference_logprobs"
SAMPLER_ASSETS = ("sft_checkpoint",)  # where on-policy samplers and references come from: drawn as graph edges
MAX_INLOOP_HELDOUT = 64  # held-out pairs scored at each in-loop evaluation
# The verifier of sampled answers: each problem's own scorer (reasoning_gym, exact_number, ...).
grade_answer = default_grade


# ---- which model a reference names ----------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceModel:
    """A model DPO measures against, or that samples on-policy pairs: a registered checkpoint's sampler
    weights, an unregistered ``tinker://`` sampler path, or the base model itself."""

    base_model: str
    sampler_path: str | None = None
    partition: str | None = None

    @property
    def identity(self) -> str:
        """What reference logprobs are keyed by: the weights, not the name used to find them."""
        return self.sampler_path or f"base:{self.base_model}"

    def describe(self) -> str:
        return f"{self.partition} ({self.sampler_path})" if self.partition else self.identity

    def lineage(self) -> dict:
        return {"partition": self.partition, "sampler_path": self.sampler_path, "base_model": self.base_model}

    def sampling_client(self, service_client):
        return reference_sampling_client(service_client, reference_model=self.sampler_path or self.base_model)


def resolve_model(reference: str, base_model: str, mlflow: MlflowResource | None, field: str) -> ReferenceModel:
    """The model ``reference`` names (``assets.chaining.resolve_sampler``): empty = ``base_model``."""
    try:
        found = resolve_sampler(reference, base_model=base_model, what=field, alias_lookup=mlflow.alias_partition if mlflow else None)
    except InitFromError as error:
        raise dg.Failure(str(error)) from error
    return ReferenceModel(found.base_model, found.sampler_path, found.partition)


def materialized_base_model(context: dg.AssetExecutionContext, tinker: TinkerResource) -> str:
    return str(latest_version(context.instance, BASE_MODEL_KEY).metadata.get("base_model", "")) or tinker.base_model


# ---- on-policy pairs --------------------------------------------------------------------------------


class OnPolicyConfig(dg.Config):
    sampler: str = Field(
        default="latest:sft",
        description="Checkpoint that answers the prompts: latest:<recipe>, best:<recipe>, a checkpoint partition key, "
        "<registered model>/<version>, or a tinker://.../sampler_weights/... path.",
    )
    group_size: int = Field(default=4, description="Answers sampled per prompt; a prompt with a correct and an incorrect one gives a pair.")
    max_tokens: int = Field(default=32, description="Answer budget per sample.")
    temperature: float = Field(default=1.0, description="Sampling temperature (higher = more varied answers, more pairs).")
    renderer: str = Field(default="auto", description="Chat renderer of the prompts (the sampler's); auto = the base model's recommended one.")
    seed: int = Field(default=0, description="Sampling seed; also picks which correct/incorrect answers form the pair.")
    limit: int = Field(default=0, description="Sample at most this many problems of either split (0 = all).")
    accumulate: bool = Field(
        default=False,
        description="Keep the comparisons of this table's latest version and add this sampler's: iterated RLHF, where "
        "each round's judge is trained on every policy so far (the last round's policy found what that judge over-rated).",
    )


def onpolicy_preview(result) -> str:
    head = (f"{result.num_pairs} pairs from {result.num_prompts} prompts; dropped {result.dropped_all_correct} all-correct "
            f"and {result.dropped_none_correct} none-correct; sample accuracy {result.sample_accuracy:.3f}\n\n")
    return head + messages_preview(result.table, ("prompt", "chosen", "rejected"))


def empty_pairs_failures(result) -> list[str]:
    if result.num_pairs:
        return []
    return [
        f"none of {result.num_prompts} prompts got both a correct and an incorrect answer ({result.dropped_all_correct} all "
        f"correct, {result.dropped_none_correct} none correct): raise group_size or temperature, or sample another checkpoint"
    ]


@dg.asset(
    name=COMPARISONS_ASSET,
    group_name=DATA_GROUP,
    kinds={"parquet", "tinker"},
    deps=[BASE_MODEL_KEY, *SAMPLER_ASSETS],
    ins={PROBLEMS_ASSET: dg.AssetIn()},
    check_specs=blocking(
        COMPARISONS_ASSET,
        ("schema_valid", "Table has the normalized preference-comparison schema."),
        ("has_pairs", "At least one prompt got both a correct and an incorrect answer."),
        ("pairs_differ", "Chosen and rejected completions differ in every row."),
    ),
    description="A checkpoint answers the rl_problems prompts group_size times; its problems' verifiers pick a correct "
    "(chosen) and an incorrect (rejected) answer per prompt. Split kept from the problems (by prompt hash).",
)
def onpolicy_comparisons(
    context: dg.AssetExecutionContext, config: OnPolicyConfig, tinker: TinkerResource, mlflow: MlflowResource, rl_problems: pa.Table
) -> Iterator:
    sampler = resolve_model(config.sampler, materialized_base_model(context, tinker), mlflow, "sampler")
    if sampler.sampler_path is None:
        raise dg.Failure(f"{COMPARISONS_ASSET}: sampler is empty; name a checkpoint to sample (default latest:sft)")
    problems = rl_problems.slice(0, config.limit) if config.limit else rl_problems
    context.log.info(f"{COMPARISONS_ASSET}: {sampler.describe()} answers {problems.num_rows} prompts x {config.group_size}")
    with data_errors(COMPARISONS_ASSET), tinker.session(f"{COMPARISONS_ASSET} from {sampler.describe()}") as client:
        result = build_onpolicy_pairs(
            client, sampler.sampler_path, get_renderer(config.renderer, load_tokenizer(sampler.base_model), base_model=sampler.base_model), problems,
            split=None, num_samples=config.group_size, max_tokens=config.max_tokens, temperature=config.temperature,
            seed=config.seed, grade=grade_answer,
        )
    table, kept_samplers, kept_version = result.table, [], ""
    if config.accumulate:
        table, kept_samplers, kept_version = _accumulated(context, result.table)
    metadata = {
        "sampler": config.sampler,
        "samplers": dg.MetadataValue.json([*kept_samplers, sampler.sampler_path]),
        "kept_rows": table.num_rows - result.table.num_rows,
        "kept_version": kept_version,
        "sampler_partition": sampler.partition or "",
        "sampler_path": sampler.sampler_path,
        "sampler_base_model": sampler.base_model,
        "prompts_used": result.num_prompts,
        "dropped_all_correct": result.dropped_all_correct,
        "dropped_none_correct": result.dropped_none_correct,
        "sample_accuracy": result.sample_accuracy,
        "group_size": config.group_size,
        "preview": dg.MetadataValue.md(onpolicy_preview(result)),
    }
    yield from checked_table_output(
        COMPARISONS_ASSET,
        table_output(table, metadata),
        [
            schema_check(table, schemas.PREFERENCE_COMPARISONS),
            failures_check("has_pairs", empty_pairs_failures(result)),
            failures_check("pairs_differ", identical_failures(table)),
        ],
    )


def _accumulated(context: dg.AssetExecutionContext, new: pa.Table) -> tuple[pa.Table, list[str], str]:
    """The latest stored version of this table followed by ``new`` (``accumulate``), the samplers it held and its
    data version (lineage: the new version names the one it extends); ``new`` alone when there is none."""
    try:
        previous = latest_version(context.instance, COMPARISONS_ASSET)
    except dg.Failure:
        context.log.info(f"{COMPARISONS_ASSET}: accumulate, but no earlier version: this sampler's comparisons start the table")
        return new, [], ""
    kept = read_versioned_table(previous.metadata, COMPARISONS_ASSET)
    try:
        table = accumulate_comparisons(kept, new)
    except ValueError as error:
        raise dg.Failure(f"{COMPARISONS_ASSET}: accumulate onto version {previous.data_version}: {error}") from error
    samplers = samplers_in(kept)
    context.log.info(f"{COMPARISONS_ASSET}: kept {kept.num_rows} comparisons of {len(samplers)} earlier sampler(s) "
                     f"(version {previous.data_version}), added {new.num_rows}")
    return table, samplers, previous.data_version


onpolicy_pairs = build_pairs_asset(
    ONPOLICY_PAIRS,
    COMPARISONS_ASSET,
    "On-policy comparisons rendered to chosen/rejected token sequences (same rendering and checks as preference_pairs).",
)


# ---- reference logprobs ------------------------------------------------------------------------------


class ReferenceConfig(dg.Config):
    pairs: Literal[PAIR_ASSETS] = Field(default=PAIR_ASSETS[0], description="Which pairs table to score (its latest version).")
    reference: str = Field(
        default="latest:sft",
        description="Reference model: latest:<recipe> (default latest:sft = the DPO run's starting weights), best:<recipe>, "
        "a partition key, a tinker://.../sampler_weights/... path; empty = the base model.",
    )


def reference_version(pairs_data_version: str, reference: ReferenceModel) -> str:
    """The data version of reference logprobs: a function of exactly what they are computed from."""
    key = json.dumps({"pairs": pairs_data_version, "reference": reference.identity}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def nonfinite_failures(table: pa.Table) -> list[str]:
    rows = table.select(["row_id", "chosen_ref_logprob_sum", "rejected_ref_logprob_sum"]).to_pylist()
    return [f"{r['row_id']}: non-finite reference logprob sum" for r in rows
            if not (math.isfinite(r["chosen_ref_logprob_sum"]) and math.isfinite(r["rejected_ref_logprob_sum"]))]


@dg.asset(
    name=REFERENCE_ASSET,
    group_name=DATA_GROUP,
    kinds={"parquet", "tinker"},
    deps=[BASE_MODEL_KEY, *PAIR_ASSETS, *SAMPLER_ASSETS],
    check_specs=blocking(
        REFERENCE_ASSET,
        ("schema_valid", "Table has the reference-logprobs schema."),
        ("finite", "Every pair's reference logprob sums are finite."),
    ),
    description="The reference model's logprobs of every pair (both splits) of one pairs version, computed once per "
    "(pairs version, reference): a DPO β sweep reads them instead of rescoring.",
)
def reference_logprobs(context: dg.AssetExecutionContext, config: ReferenceConfig, tinker: TinkerResource, mlflow: MlflowResource) -> Iterator:
    check_choice_is_fresh(context, REFERENCE_ASSET, "pairs", config.pairs, PAIR_ASSETS)
    pairs_version = latest_version(context.instance, config.pairs)
    reference = resolve_model(config.reference, materialized_base_model(context, tinker), mlflow, "reference")
    version = reference_version(pairs_version.data_version, reference)
    reference_asset = read_manifest(reference.partition).training_asset if reference.partition else None
    cache = state_subdir(REFERENCE_ASSET) / f"{version}.parquet"
    cached = cache.exists()
    if cached:
        context.log.info(f"{REFERENCE_ASSET}: cached {cache} ({config.pairs} {pairs_version.data_version}, {reference.describe()})")
        table = pq.read_table(cache)
    else:
        with data_errors(REFERENCE_ASSET):
            stored = read_versioned_table(pairs_version.metadata, f"{config.pairs} (run {pairs_version.run_id})")
            pairs = PreferencePairs(pairs_from_table(stored, split=None)).pairs
        with tinker.session(f"{REFERENCE_ASSET} with {reference.describe()}") as client:
            table = compute_reference_logprobs(reference.sampling_client(client), pairs)
        with staged(cache) as staging:  # runs sharing these pairs and reference may write it at once
            pq.write_table(table, staging)
    metadata = {
        "dagster/row_count": dg.MetadataValue.int(table.num_rows),
        "cached": cached,
        "pairs_asset": config.pairs,
        "pairs_data_version": pairs_version.data_version,
        "reference": config.reference,
        "reference_identity": reference.identity,
        "reference_partition": reference.partition or "",
        "reference_sampler_path": reference.sampler_path or "",
        "reference_base_model": reference.base_model,
        **unread_inputs_metadata([name for name in (*PAIR_ASSETS, *SAMPLER_ASSETS) if name not in (config.pairs, reference_asset)]),
    }
    output = versioned_output(table, metadata, version)
    yield from checked_table_output(REFERENCE_ASSET, output, [schema_check(table, REFERENCE_LOGPROBS), failures_check("finite", nonfinite_failures(table))])


# ---- DPO training ------------------------------------------------------------------------------------


def run_reference(config: DpoConfig, parent: ParentCheckpoint | None, base_model: str) -> ReferenceModel | None:
    """The reference a DPO run measures against (None: an unregistered raw state, known only by its weights)."""
    if config.reference_model:
        if config.reference_model.startswith("tinker://"):
            return ReferenceModel(base_model, config.reference_model)
        return ReferenceModel(config.reference_model)
    if parent is None:
        return ReferenceModel(base_model)  # a fresh LoRA (B = 0) computes exactly the base model
    if parent.manifest is None or not parent.manifest.sampler_path:
        return None
    return ReferenceModel(parent.manifest.base_model, parent.manifest.sampler_path, parent.manifest.partition)


def matching_reference(context: dg.AssetExecutionContext, pairs_asset: str, pairs: UpstreamVersion, reference: ReferenceModel | None) -> tuple[pa.Table, UpstreamVersion] | None:
    """The latest ``reference_logprobs`` when it was computed for this pairs version and this reference."""
    if reference is None:
        context.log.info("DPO reference is an unregistered raw state: the recipe computes its own reference logprobs")
        return None
    try:
        stored = latest_version(context.instance, REFERENCE_ASSET)
    except dg.Failure:
        context.log.info(f"{REFERENCE_ASSET} was never materialized: the recipe computes its own reference logprobs")
        return None
    expected = reference_version(pairs.data_version, reference)
    if stored.data_version != expected:
        context.log.info(
            f"{REFERENCE_ASSET} {stored.data_version} was computed for {stored.metadata.get('pairs_asset')} "
            f"{stored.metadata.get('pairs_data_version')} with {stored.metadata.get('reference_identity')}, not {pairs_asset} "
            f"{pairs.data_version} with {reference.identity}: the recipe computes its own reference logprobs "
            f"(materialize {REFERENCE_ASSET} with pairs={pairs_asset} to share them across runs)"
        )
        return None
    context.log.info(f"DPO reads {REFERENCE_ASSET} {stored.data_version} (run {stored.run_id}): no reference scoring in this run")
    return read_versioned_table(stored.metadata, f"{REFERENCE_ASSET} (run {stored.run_id})"), stored


def pair_sampler(context: dg.AssetExecutionContext, pairs: UpstreamVersion) -> dict | None:
    """The checkpoint that sampled on-policy pairs (from the comparisons version they were rendered from)."""
    comparisons = inputs_of(context.instance, pairs).get(COMPARISONS_ASSET)
    if comparisons is None:
        return None
    return {"partition": comparisons.metadata.get("sampler_partition") or None, "sampler_path": comparisons.metadata.get("sampler_path"),
            "comparisons_data_version": comparisons.data_version}


def build_dpo(inputs: RecipeInputs) -> RecipeRun:
    config: DpoConfig = inputs.config
    context = inputs.context
    pairs_asset = inputs.launch_config.pairs
    pairs_version = inputs.versions[pairs_asset]
    table = inputs.tables[pairs_asset]
    reference = run_reference(config, inputs.parent, inputs.base_model)
    shared = matching_reference(context, pairs_asset, pairs_version, reference)
    try:
        heldout = pairs_from_table(table, split=HELDOUT_SPLIT)[:MAX_INLOOP_HELDOUT]
        recipe = DpoRecipe(
            config, PreferencePairs.from_table(table, split=TRAIN_SPLIT), reference=shared[0] if shared else None,
            heldout=PreferencePairs(heldout) if heldout else None,
        )
    except ValueError as error:
        raise dg.Failure(f"dpo_checkpoint: {pairs_asset} {pairs_version.data_version}: {error}") from error
    if reference is not None:
        reference_lineage = reference.lineage()
    else:  # known only as the raw state it starts from
        reference_lineage = {"partition": None, "state_path": inputs.parent.state_path if inputs.parent else None}
    if shared:
        reference_lineage["logprobs"] = {"data_version": shared[1].data_version, "dagster_run_id": shared[1].run_id,
                                         "path": shared[1].metadata.get(VERSION_PATH_KEY)}
    related = {
        "reference": reference_lineage,
        "pairs": {"asset": pairs_asset, "data_version": pairs_version.data_version},
        "dpo": {"beta": config.beta},
    }
    sampler = pair_sampler(context, pairs_version)
    if sampler:
        related["pair_sampler"] = sampler
    evaluators = [recipe.heldout_evaluator()] if heldout else []
    return RecipeRun(recipe, evaluators=evaluators, related=related, renderer=str(pairs_version.metadata.get("renderer", "")),
                     read={REFERENCE_ASSET: shared[1]} if shared else {})


DPO = TrainingSpec(
    recipe="dpo",
    library_config=DpoConfig,
    ins={},  # the pairs table is the launchpad's choice (input_choice): the only table DPO reads
    build=build_dpo,
    parent_assets=SAMPLER_ASSETS,
    default_init_from="latest:sft",
    # A gentle LR: on the demo task a much higher one overfit the pairs and lowered held-out accuracy (docs/benchmarks.md).
    defaults={"learning_rate": 2e-5, "lora_rank": 16, "save_every": 10},
    extra_deps=(REFERENCE_ASSET,),
    input_choice=("pairs", PAIR_ASSETS),
    description="DPO from a parent checkpoint (default latest:sft) on on-policy or offline pairs; reference logprobs "
    "come from reference_logprobs when they match; every saved checkpoint becomes a `dpo_checkpoints` partition.",
)
dpo_checkpoint = build_training_asset(DPO)
dpo_checkpoints = build_checkpoints_asset(DPO)


# ---- evaluation --------------------------------------------------------------------------------------


def heldout_reference(manifest: CheckpointManifest, heldout: list, service) -> pa.Table | Callable[[], pa.Table]:
    """The reference logprobs of the held-out pairs: the ``reference_logprobs`` table the run trained with
    (it covers both splits), else scored with the recorded reference model at the first evaluation."""
    recorded = manifest.related["reference"]
    shared = recorded.get("logprobs")
    if shared:
        return read_versioned_table({VERSION_PATH_KEY: shared["path"]}, f"{REFERENCE_ASSET} {shared['data_version']} of {manifest.partition}")
    reference = ReferenceModel(recorded.get("base_model") or manifest.base_model, recorded.get("sampler_path"))
    return lambda: compute_reference_logprobs(reference.sampling_client(service()), heldout)


def dpo_evaluators(inputs: EvalInputs) -> list:
    """Held-out pair accuracy, reward margin and DPO loss under the run's implicit reward β·(lp − lp_ref), on the
    held-out pairs of the exact pairs version trained on (on-policy or offline), against the run's reference."""
    config, manifest = inputs.config, inputs.manifest
    if inputs.tinker is None:
        raise dg.Failure("dpo_eval_report needs the tinker resource to score the reference")
    pairs_asset = manifest.related["pairs"]["asset"]
    heldout = pairs_from_table(inputs.tables[pairs_asset], split=HELDOUT_SPLIT)
    heldout = heldout[: config.max_heldout_sequences] if config.max_heldout_sequences else heldout
    if not heldout:
        raise dg.Failure(
            f"the {pairs_asset} version {manifest.partition} was trained on has no held-out pairs: materialize its "
            "comparisons with heldout_fraction > 0"
        )
    recorded = manifest.related["reference"]
    if recorded.get("state_path"):
        raise dg.Failure(
            f"the reference of {manifest.partition} is the raw state {recorded['state_path']}, which has no sampler weights to "
            "score held-out pairs with: train DPO from a registered checkpoint (partition key, latest:<recipe>)"
        )
    reference = heldout_reference(manifest, heldout, inputs.tinker.get_client)
    return [PairAccuracyEvaluator(heldout, reference, manifest.related["dpo"]["beta"], prefix="")]


DPO_EVAL = EvalSpec(training=DPO, data_assets=PAIR_ASSETS, evaluators=dpo_evaluators, score_metric="pair_accuracy")
dpo_eval_report = build_eval_asset(DPO_EVAL)

DPO_DATA_ASSETS = ("base_model", PROBLEMS_ASSET, COMPARISONS_ASSET, ONPOLICY_PAIRS, REFERENCE_ASSET)
# DPO on offline pairs (HH-RLHF, UltraFeedback ... or a local file), from the base model, in one job: `dpo_offline_chain`.
DPO_OFFLINE_DATA_ASSETS = ("base_model", "preference_comparisons", OFFLINE_PAIRS, REFERENCE_ASSET)
DPO_OFFLINE_DEFAULTS = {
    REFERENCE_ASSET: {"pairs": OFFLINE_PAIRS, "reference": ""},
    "dpo_checkpoint": {"pairs": OFFLINE_PAIRS, "init_from": ""},
}
DPO_ASSETS = (onpolicy_comparisons, onpolicy_pairs, reference_logprobs, dpo_checkpoint, dpo_checkpoints, dpo_eval_report)
