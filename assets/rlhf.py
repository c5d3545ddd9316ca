"""RLHF on the platform: an SFT checkpoint trained by RL against a preference model (``rlhf_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with RLHF's spec: it starts from the newest SFT
checkpoint (``latest:sft``), answers the train-split prompts of the table chosen as ``env``
(``rl_problems`` by default — prompts with a verifier — or the prompts of a comparisons table), and
rewards each sample with its win fraction in its group's tournament, judged by the preference-model
checkpoint ``preference_model`` names (``posttrain.preference.rlhf.RLHFRecipe``; every RL loss, KL option
and driver of the RL recipe applies). The judge must be a ``preference_model`` checkpoint of the same base
model and tokenizer; anything else is refused before training starts.

Lineage: each manifest names its SFT parent (``init_from``), the preference-model checkpoint that rewarded
it and that model's comparisons table version (``related.preference_model``), the checkpoint that wrote the
reference answers of a judge that answers first, where one did (``related.judge_reference``), and the prompt
table version (``upstream``). Every sample, with its pairwise scores, is a row of ``rlhf_rollout_batches``.

``rlhf_eval_report``: on the held-out prompts of the exact prompt version trained on, the win rate (± s.e.)
of the checkpoint over its parent judged by the recorded preference model (both orders), and — where the
prompts have a verifier — the true held-out accuracy, which the RL stage never saw as a reward.
"""

from pathlib import Path

import dagster as dg

from assets.base_model import materialized_base_model
from assets.chaining import InitFromError, resolve_sampler
from assets.checkpoint_manifest import CheckpointManifest, read_manifest
from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.preference_model import judge_answers_first
from assets.rollouts import build_rollouts_asset
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.eval.base import EvalTarget
from posttrain.preference.comparison_eval import ComparisonEvaluator
from posttrain.preference.comparison_format import ComparisonRenderer
from posttrain.preference.env import PreferenceDataset, TournamentSettings, prompts_from_comparisons, prompts_from_problems
from posttrain.preference.preference_model import PreferenceModel
from posttrain.preference.rlhf import RLHFConfig, RLHFRecipe
from posttrain.renderers import get_renderer
from posttrain.training.rows import JsonlRowSink
from resources.models import load_tokenizer

RECIPE = "rlhf"
JUDGE_RECIPE = "preference_model"
PROMPT_ASSETS = ("rl_problems", "onpolicy_comparisons", "preference_comparisons")  # the launchpad's `env` choice
ROLLOUTS_FILE = "rollouts.jsonl"


def load_prompts(asset: str, table, split: str, system: str | None = None) -> list:
    if asset == "rl_problems":
        return prompts_from_problems(table, split, system)
    return prompts_from_comparisons(table, split)


def resolve_judge(inputs: RecipeInputs, reference: str) -> CheckpointManifest:
    """The preference-model checkpoint ``reference`` names, refused unless it judges with this run's tokenizer."""
    try:
        found = resolve_sampler(reference, base_model=inputs.base_model, what="preference_model")
    except InitFromError as error:
        raise dg.Failure(f"{RECIPE}_checkpoint: {error}") from error
    manifest = found.manifest
    if manifest is None or found.sampler_path is None:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: preference_model={reference!r} is not a registered checkpoint, so its base model, tokenizer "
            "and comparison data cannot be checked: name a preference_model checkpoint (latest:preference_model, a partition key)"
        )
    if manifest.recipe != JUDGE_RECIPE:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: preference_model={reference!r} is a {manifest.recipe} checkpoint ({manifest.partition}), not a "
            f"{JUDGE_RECIPE}: train one with the {JUDGE_RECIPE}_train job and name it (default latest:{JUDGE_RECIPE})"
        )
    expected = materialized_base_model(inputs.context.instance, f"{RECIPE}_checkpoint").tokenizer
    tokenizer = f"{expected.name}@{expected.digest[:16]}"
    if manifest.tokenizer and manifest.tokenizer != tokenizer:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: the preference model {manifest.partition} reads tokens of tokenizer {manifest.tokenizer}, this "
            f"run's base model has {tokenizer}: train a preference model on the current base_model"
        )
    return manifest


def resolve_reference_from(inputs: RecipeInputs, reference: str, judged_by: dict) -> dict | None:
    """The sampler ``judge_reference_from`` names (partition and sampler path), None when empty; refused for a
    judge that does not answer first (``judged_by``: its :func:`judge_lineage`), which has no reference slot."""
    if not reference.strip():
        return None
    if not judged_by["answers_first"]:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: judge_reference_from={reference!r} fills the reference slot of a judge that answers first, "
            f"but the preference model {judged_by['partition']} was trained without references: train one with reference: chosen, "
            "or leave judge_reference_from empty"
        )
    try:
        found = resolve_sampler(reference, base_model=inputs.base_model, what="judge_reference_from")
    except InitFromError as error:
        raise dg.Failure(f"{RECIPE}_checkpoint: {error}") from error
    return {"partition": found.partition, "sampler_path": found.sampler_path}


def judge_lineage(judge: CheckpointManifest) -> dict:
    comparisons = judge.related.get("comparisons", {})
    asset = comparisons.get("asset")
    recorded = judge.upstream.get(asset, {}) if asset else {}
    return {
        "partition": judge.partition,
        "sampler_path": judge.sampler_path,
        "state_path": judge.state_path,
        "renderer": judge.renderer,
        "answers_first": judge_answers_first(comparisons),
        "comparisons": {"asset": asset, "data_version": comparisons.get("data_version"), "dagster_run_id": recorded.get("dagster_run_id")},
    }


def build_rlhf(inputs: RecipeInputs) -> RecipeRun:
    config: RLHFConfig = inputs.config
    problems = config.problems()
    if problems:
        raise dg.Failure(f"{RECIPE}_checkpoint config is invalid: {'; '.join(problems)}")
    split = config.env_options.get("split", TRAIN_SPLIT)
    if split == HELDOUT_SPLIT:
        raise dg.Failure(f"{RECIPE}_checkpoint: env_options.split={HELDOUT_SPLIT!r} would train on the prompts rlhf_eval_report holds out")
    unknown = sorted(set(config.env_options) - {"split", "num_epochs", "system"})
    if unknown:
        raise dg.Failure(f"{RECIPE}_checkpoint: env_options {unknown} are unknown; RLHF takes split, num_epochs and system")
    judge = resolve_judge(inputs, config.preference_model)
    judged_by = judge_lineage(judge)
    reference_from = resolve_reference_from(inputs, config.judge_reference_from, judged_by)
    tokenizer = load_tokenizer(inputs.base_model)
    asset = config.env
    version = inputs.versions[asset]
    try:
        renderer = get_renderer(config.renderer, tokenizer)
        prompts = load_prompts(asset, inputs.tables[asset], split, config.env_options.get("system"))
        dataset = PreferenceDataset(
            prompts, renderer, group_size=config.group_size, groups_per_batch=config.groups_per_batch, seed=config.training.seed,
            num_epochs=int(config.env_options.get("num_epochs", 1)),
            settings=TournamentSettings(config.tournament, config.tournament_chunk_size, config.format_coef),
        )
        judge_renderer = ComparisonRenderer(get_renderer(judge.renderer or config.renderer, tokenizer))
        recipe = RLHFRecipe(
            config, dataset, judge_renderer, judge.sampler_path or "", tokenizer, inputs.parent_sampler_path,
            judge_answers_first=judged_by["answers_first"],
            reference_path=reference_from["sampler_path"] if reference_from else None,
        )
    except (ValueError, KeyError) as error:
        raise dg.Failure(f"{RECIPE}_checkpoint: {asset} {version.data_version}: {error}") from error
    return RecipeRun(
        recipe,
        row_sinks=[JsonlRowSink(Path(inputs.log_dir) / ROLLOUTS_FILE)],
        related={
            "preference_model": judged_by,
            **({"judge_reference": reference_from} if reference_from else {}),
            "prompts": {"asset": asset, "data_version": version.data_version, "split": split},
            "tournament": {"pattern": config.tournament, "chunk_size": config.tournament_chunk_size, "judge_orders": config.judge_orders},
        },
        renderer=config.renderer,
    )


RLHF = TrainingSpec(
    recipe=RECIPE,
    library_config=RLHFConfig,
    ins={},
    build=build_rlhf,
    parent_assets=("sft_checkpoint",),
    default_init_from="latest:sft",
    defaults={"save_every": 5, "learning_rate": 1e-4},
    extra_deps=(f"{JUDGE_RECIPE}_checkpoint",),
    input_choice=("env", PROMPT_ASSETS),
    description="RLHF: RL from a parent checkpoint (default latest:sft) with rewards from a preference model's pairwise "
    "tournaments; every saved checkpoint becomes an `rlhf_checkpoints` partition and every sample a row of `rlhf_rollout_batches`.",
)
rlhf_checkpoint = build_training_asset(RLHF)
rlhf_checkpoints = build_checkpoints_asset(RLHF)
rlhf_rollout_batches = build_rollouts_asset(
    "rlhf_rollout_batches", "rlhf_checkpoint",
    "Every sample of the latest rlhf_checkpoint run (prompt, completion, tokens, sampler logprobs, reward = win fraction, "
    "advantage, pairwise_scores: each opponent and the win the preference model gave) with the sampler weights that produced it.",
)


def rlhf_evaluators(inputs: EvalInputs) -> list:
    """Win rate over the parent (over the base model when there is none) judged by the recorded preference model,
    and verifier accuracy where the prompts have one, on the held-out prompts of the trained prompt version."""
    config, manifest = inputs.config, inputs.manifest
    if inputs.tinker is None:
        raise dg.Failure("rlhf_eval_report needs the tinker resource to sample the parent and to run the preference model")
    recorded, judge = manifest.related["prompts"], manifest.related["preference_model"]
    prompts = load_prompts(recorded["asset"], inputs.tables[recorded["asset"]], HELDOUT_SPLIT)
    prompts = prompts[: config.max_problems] if config.max_problems else prompts
    if not prompts:
        raise dg.Failure(
            f"the {recorded['asset']} version {recorded['data_version']} that {manifest.partition} was trained on has no "
            f"{HELDOUT_SPLIT!r} prompts: materialize it with heldout_fraction > 0"
        )
    service = inputs.tinker.get_client
    renderer = get_renderer(manifest.renderer or "chatml", inputs.tokenizer)
    judge_renderer = ComparisonRenderer(get_renderer(judge.get("renderer") or manifest.renderer or "chatml", inputs.tokenizer))
    parent_sampler = read_manifest(manifest.parent_partition).sampler_path if manifest.parent_partition else None

    def opponent() -> EvalTarget:
        if parent_sampler:
            return EvalTarget.from_checkpoint(service(), parent_sampler, inputs.tokenizer)
        return EvalTarget.from_base_model(service(), manifest.base_model, inputs.tokenizer)

    def preference_model() -> PreferenceModel:
        client = service().create_sampling_client(model_path=judge["sampler_path"]).result()
        reference_from = manifest.related.get("judge_reference")
        answerer = service().create_sampling_client(model_path=reference_from["sampler_path"]).result() if reference_from else None
        return PreferenceModel(client, judge_renderer, answers_first=bool(judge.get("answers_first")), answer_max_tokens=config.max_tokens,
                               answerer=answerer)

    return [ComparisonEvaluator(renderer, prompts, opponent, preference_model, max_tokens=config.max_tokens, seed=config.seed)]


RLHF_EVAL = EvalSpec(training=RLHF, data_assets=PROMPT_ASSETS, evaluators=rlhf_evaluators, score_metric="win_rate")
rlhf_eval_report = build_eval_asset(RLHF_EVAL)

RLHF_DATA_ASSETS = ("base_model", "rl_problems")
RLHF_ASSETS = (rlhf_checkpoint, rlhf_checkpoints, rlhf_rollout_batches, rlhf_eval_report)
