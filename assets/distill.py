"""Distillation on the platform: on-policy (``distill_checkpoint``) and prompt distillation
(``teacher_responses`` → ``prompt_distill_checkpoint``).

On-policy: the student (a fresh LoRA on the base model, or ``init_from``) samples the train prompts of the
table chosen in the launchpad (``prompts``: ``rl_problems``, ``chat_dataset`` or ``preference_comparisons``;
``posttrain.distill.prompts``); the teacher of each prompt's dataset — a checkpoint named by reference
(partition key, ``latest:<recipe>``, ``best:<recipe>``, a ``tinker://`` sampler path) or the base model —
scores every sampled token (``posttrain.distill``). Teachers are recorded in each checkpoint manifest
(``related.teachers``) so ``python -m pipelines lineage`` reaches their training data; the eval report
gives held-out ``teacher_kl`` (``best`` follows it) on the trained prompts version's held-out prompts and,
when they have gold answers, task accuracy and the teachers' own accuracy, against the base model and the
student's start (the parent column).

Prompt distillation: a teacher plus a system prompt answers the prompts of the table chosen in the
launchpad (``teacher_responses``'s ``prompts``: the same three tables), giving a checked chat table
*without* the system prompt, split kept; SFT of the student on the train answers; the eval report gives
held-out agreement with the teacher and, when the prompts table has gold answers, held-out task accuracy —
both on the held-out prompts of the exact prompts version the teacher answered.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import dagster as dg
import pyarrow as pa
from pydantic import Field

from assets.base_model import BASE_MODEL_KEY
from assets.chaining import InitFromError, resolve_sampler
from assets.checkpoint_manifest import CheckpointManifest
from assets.datasets import (
    DATA_GROUP,
    blocking,
    checked_table_output,
    data_errors,
    empty_conversation_failures,
    failures_check,
    messages_preview,
    schema_check,
    table_output,
)
from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.problems import PROBLEMS_ASSET
from assets.rl import side_loading_error
from assets.training import (
    RecipeInputs,
    RecipeRun,
    TrainingSpec,
    build_checkpoints_asset,
    build_training_asset,
    check_choice_is_fresh,
)
from assets.upstream import latest_version, read_versioned_table, unread_inputs_metadata
from posttrain.datasets import schemas
from posttrain.datasets.problems import rl_problems_from_table
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.datasets.tokens import render_chat_table, tokenizer_identity
from posttrain.distill import DistillConfig, DistillRecipe, Teacher, TeacherRouting
from posttrain.distill.evals import RoutedProblem, TeacherAccuracyEvaluator, TeacherKLEvaluator
from posttrain.distill.prompt import (
    AgreementEvaluator,
    PromptDistillConfig,
    PromptDistillRecipe,
    TeacherSampling,
    agreement_problems,
    teacher_responses as answer_prompts,
)
from posttrain.distill.prompts import has_gold_answers, prompts_table
from posttrain.eval.accuracy import AccuracyEvaluator, TaskProblem, problems_from_table
from posttrain.renderers import get_renderer
from posttrain.rl.envs import build_rl_dataset
from posttrain.supervised.data import RenderedTokens
from posttrain.training.rows import JsonlRowSink
from resources.mlflow import MlflowResource
from resources.models import load_tokenizer
from resources.tinker import TinkerResource

RESPONSES_ASSET = "teacher_responses"
TABLE_ENV = "problems"
TEACHER_ASSETS = ("sft_checkpoint", "rl_checkpoint")  # where teachers come from: drawn as graph edges
PROMPT_ASSETS = (PROBLEMS_ASSET, "chat_dataset", "preference_comparisons")  # tables distillation may draw prompts from
STUDENT_PARENTS = ("sft_checkpoint", "dpo_checkpoint", "rl_checkpoint")  # checkpoints a student may start from (init_from)
ROLLOUTS_FILE = "distill_rollouts.jsonl"
DEFAULT_SYSTEM_PROMPT = "You are a careful calculator. Think briefly, then end with 'The answer is N.'"


# ---- teachers ------------------------------------------------------------------------------------


def resolve_teacher(reference: str, base_model: str, mlflow: MlflowResource | None) -> tuple[Teacher, CheckpointManifest | None]:
    """The teacher ``reference`` names (``assets.chaining.resolve_sampler``; empty = the base model), with its
    manifest when it is registered. A teacher may have another base model: its tokenizer is checked later."""
    try:
        found = resolve_sampler(
            reference, base_model=base_model, what=f"teacher {reference!r}",
            alias_lookup=mlflow.alias_partition if mlflow else None, same_base_model=False,
        )
    except InitFromError as error:
        raise dg.Failure(str(error)) from error
    name = found.partition or found.sampler_path or found.base_model
    identity = tokenizer_identity(load_tokenizer(found.base_model), found.base_model)
    return Teacher(name, found.base_model, found.sampler_path, identity), found.manifest


def teacher_lineage(dataset: str, teacher: Teacher, manifest: CheckpointManifest | None) -> dict:
    return {"dataset": dataset, "partition": manifest.partition if manifest else None, "name": teacher.name,
            "sampler_path": teacher.sampler_path, "base_model": teacher.base_model}


def routing_from_lineage(entries: list[dict]) -> TeacherRouting:
    """The teachers a checkpoint was trained against, from its manifest's ``related.teachers``."""
    teachers = {}
    for entry in entries:
        identity = tokenizer_identity(load_tokenizer(entry["base_model"]), entry["base_model"])
        teachers[entry["dataset"]] = Teacher(entry["name"], entry["base_model"], entry["sampler_path"], identity)
    return TeacherRouting(teachers)


# ---- on-policy distillation ----------------------------------------------------------------------


def build_distill(inputs: RecipeInputs) -> RecipeRun:
    config: DistillConfig = inputs.config
    problems = config.problems()
    if problems:
        raise dg.Failure(f"distill_checkpoint config is invalid: {'; '.join(problems)}")
    mlflow = getattr(inputs.context.resources, "mlflow", None)
    resolved = {dataset: resolve_teacher(reference, inputs.base_model, mlflow) for dataset, reference in config.teachers.items()}
    routing = TeacherRouting({dataset: teacher for dataset, (teacher, _) in resolved.items()})
    if config.env != TABLE_ENV:
        raise dg.Failure(side_loading_error("distill_checkpoint", config.env))
    prompts_asset = inputs.launch_config.prompts
    tokenizer = load_tokenizer(inputs.base_model)
    try:
        table = prompts_table(inputs.tables[prompts_asset])
        for task in sorted({p.task or config.env for p in rl_problems_from_table(table, TRAIN_SPLIT)}):
            routing.teacher_for(task)  # every train task must have a teacher before anything is sampled
        renderer = get_renderer(config.renderer, tokenizer, base_model=inputs.base_model)
        dataset = build_rl_dataset(
            TABLE_ENV, renderer, group_size=config.group_size,
            groups_per_batch=config.groups_per_batch, seed=config.training.seed,
            format_coef=config.format_coef, table=table, options=config.env_options,
        )
        recipe = DistillRecipe(config, dataset, routing, tokenizer)
    except (ValueError, KeyError) as error:
        raise dg.Failure(f"distill_checkpoint: {error}") from error
    return RecipeRun(
        recipe,
        row_sinks=[JsonlRowSink(Path(inputs.log_dir) / ROLLOUTS_FILE)],
        related={
            "teachers": [teacher_lineage(dataset, teacher, manifest) for dataset, (teacher, manifest) in sorted(resolved.items())],
            "env": {"name": TABLE_ENV, "options": dict(config.env_options)},
            "prompts": {"asset": prompts_asset, "data_version": inputs.data_version(prompts_asset)},
        },
        renderer=renderer.name,
    )


DISTILL = TrainingSpec(
    recipe="distill",
    library_config=DistillConfig,
    ins={},  # the prompts table is the launchpad's choice (input_choice)
    build=build_distill,
    defaults={"env": TABLE_ENV, "teachers": {"*": "latest:sft"}, "save_every": 5, "learning_rate": 1e-4, "lora_rank": 16},
    parent_assets=STUDENT_PARENTS,
    extra_deps=TEACHER_ASSETS,
    input_choice=("prompts", PROMPT_ASSETS),
    description="On-policy distillation: the student samples the prompts of the chosen table (rl_problems, chat_dataset or "
    "preference_comparisons), each prompt's teacher scores every token (reverse KL); every saved checkpoint becomes a "
    "`distill_checkpoints` partition.",
)
distill_checkpoint = build_training_asset(DISTILL)
distill_checkpoints = build_checkpoints_asset(DISTILL)


def distill_evaluators(inputs: EvalInputs) -> list:
    """Held-out teacher KL on the held-out prompts of the exact prompts version trained on; with gold answers
    (an rl_problems table) also the student's greedy task accuracy and the teachers' own accuracy."""
    config, manifest = inputs.config, inputs.manifest
    if inputs.tinker is None:
        raise dg.Failure("distill_eval_report needs the tinker resource to score with the teachers")
    prompts_asset = manifest.related.get("prompts", {}).get("asset", PROBLEMS_ASSET)
    source = inputs.tables[prompts_asset]
    table = prompts_table(source)
    heldout = rl_problems_from_table(table, HELDOUT_SPLIT)[: config.max_problems or None]
    if not heldout:
        raise dg.Failure(f"the {prompts_asset} version {manifest.partition} was trained on has no held-out prompts")
    problems = [TaskProblem(p.question, p.answer, row_id=p.row_id, scorer=p.scorer or None, scorer_metadata=p.scorer_metadata) for p in heldout]
    routed = [RoutedProblem(problem, row.task or TABLE_ENV) for problem, row in zip(problems, heldout)]
    routing = routing_from_lineage(manifest.related.get("teachers", []))
    renderer = get_renderer(manifest.renderer or "chatml", inputs.tokenizer)
    service = inputs.tinker.get_client
    sampling = {"max_tokens": config.max_tokens, "seed": config.seed}
    evaluators: list = [TeacherKLEvaluator(renderer, routed, routing, service, **sampling)]
    if has_gold_answers(source):  # chat and comparison prompts have none
        evaluators += [AccuracyEvaluator(renderer, problems, prefix="", **sampling),
                       TeacherAccuracyEvaluator(renderer, routed, routing, service, **sampling)]
    return evaluators


DISTILL_EVAL = EvalSpec(training=DISTILL, data_assets=PROMPT_ASSETS, evaluators=distill_evaluators, score_metric="teacher_kl")
distill_eval_report = build_eval_asset(DISTILL_EVAL)


# ---- prompt distillation -------------------------------------------------------------------------


class TeacherResponsesConfig(dg.Config):
    prompts: Literal[PROMPT_ASSETS] = Field(  # type: ignore[valid-type]
        default=PROBLEMS_ASSET,
        description=f"Which table's prompts the teacher answers: {', '.join(PROMPT_ASSETS)} (its latest version; a chat "
        "or comparison table gives its last user turn before the reply). Its held-out rows become held-out answers.",
    )
    teacher: str = Field(
        default="",
        description="Teacher: empty = the base model; a checkpoint partition key, latest:<recipe>, best:<recipe>, or a "
        "tinker://.../sampler_weights/... path.",
    )
    system_prompt: str = Field(default=DEFAULT_SYSTEM_PROMPT, description="The system prompt the teacher answers under (left out of the rows).")
    renderer: str = Field(default="auto", description="Chat renderer of the teacher's prompts; auto = the base model's recommended one.")
    max_tokens: int = Field(default=64, description="Teacher answer budget.")
    temperature: float = Field(default=0.0, description="0 = greedy answers; > 0 = sampled at this temperature.")
    seed: int = Field(default=0, description="Sampling seed (per prompt: seed + position).")
    limit: int = Field(default=0, description="Answer at most this many prompts (0 = every prompt, both splits).")


def truncated_answers(table: pa.Table) -> list[str]:
    return [f"{row['row_id']}: empty teacher answer" for row in table.select(["row_id", "messages"]).to_pylist()
            if not row["messages"][-1]["content"].strip()]


@dg.asset(
    name=RESPONSES_ASSET,
    group_name=DATA_GROUP,
    kinds={"parquet", "tinker"},
    deps=[BASE_MODEL_KEY, *TEACHER_ASSETS, *PROMPT_ASSETS],  # the prompts table is the config's choice: one is read
    check_specs=blocking(
        RESPONSES_ASSET,
        ("schema_valid", "Table has the normalized chat schema (posttrain.datasets.schemas.CHAT)."),
        ("has_assistant_turns", "Every row has the teacher's answer as an assistant message."),
        ("answers_not_empty", "No teacher answer is empty (an empty answer teaches the student to stop at once)."),
    ),
    description="A teacher (checkpoint or base model) answers the prompts of the chosen table (rl_problems, chat_dataset "
    "or preference_comparisons) under a system prompt; rows hold the prompt WITHOUT the system prompt and the teacher's "
    "answer (prompt distillation's SFT data).",
)
def teacher_responses(context: dg.AssetExecutionContext, config: TeacherResponsesConfig, tinker: TinkerResource, mlflow: MlflowResource) -> Iterator:
    check_choice_is_fresh(context, RESPONSES_ASSET, "prompts", config.prompts, PROMPT_ASSETS)
    base_model = str(latest_version(context.instance, BASE_MODEL_KEY).metadata.get("base_model", "")) or tinker.base_model
    teacher, manifest = resolve_teacher(config.teacher, base_model, mlflow)
    prompts_version = latest_version(context.instance, config.prompts)
    with data_errors(RESPONSES_ASSET):
        table = prompts_table(read_versioned_table(prompts_version.metadata, f"{config.prompts} (run {prompts_version.run_id})"))
        problems = rl_problems_from_table(table)
    problems = problems[: config.limit] if config.limit else problems
    sampling = TeacherSampling(config.system_prompt, config.max_tokens, config.temperature, config.seed)
    with tinker.session(f"{RESPONSES_ASSET} from {teacher.name}") as client:
        renderer = get_renderer(config.renderer, load_tokenizer(teacher.base_model), base_model=teacher.base_model)
        try:
            rows = answer_prompts(teacher.create_sampling_client(client), renderer, problems, sampling, source=f"teacher:{teacher.name}")
        except ValueError as error:
            raise dg.Failure(f"{RESPONSES_ASSET}: {error}") from error
    table = schemas.table_from_rows(rows, schemas.CHAT)
    teacher_asset = manifest.training_asset if manifest else None
    unread = [name for name in (*PROMPT_ASSETS, *TEACHER_ASSETS) if name not in (config.prompts, teacher_asset)]
    output = table_output(table, {
        "teacher": teacher.name,
        "teacher_partition": manifest.partition if manifest else "",
        "teacher_sampler_path": teacher.sampler_path or "",
        "teacher_base_model": teacher.base_model,
        "system_prompt": config.system_prompt,
        "prompts_asset": config.prompts,
        "prompts_data_version": prompts_version.data_version,
        **unread_inputs_metadata(unread),
        "preview": dg.MetadataValue.md(messages_preview(table, ("messages",))),
    })
    yield from checked_table_output(RESPONSES_ASSET, output, [
        schema_check(table, schemas.CHAT),
        failures_check("has_assistant_turns", empty_conversation_failures(table)),
        failures_check("answers_not_empty", truncated_answers(table)),
    ])


def build_prompt_distill(inputs: RecipeInputs) -> RecipeRun:
    config: PromptDistillConfig = inputs.config
    responses = inputs.tables[RESPONSES_ASSET]
    try:
        renderer = get_renderer(config.renderer, load_tokenizer(inputs.base_model), base_model=inputs.base_model)
        tokens = render_chat_table(responses, renderer, "last_assistant_message", config.max_length)
        recipe = PromptDistillRecipe(config.supervised(), RenderedTokens(tokens, split=TRAIN_SPLIT),
                                     data_version=inputs.data_version(RESPONSES_ASSET))
    except ValueError as error:
        raise dg.Failure(f"prompt_distill_checkpoint: {error}") from error
    metadata = inputs.versions[RESPONSES_ASSET].metadata
    teacher = {"partition": metadata.get("teacher_partition") or None, "sampler_path": metadata.get("teacher_sampler_path"),
               "name": metadata.get("teacher"), "system_prompt": metadata.get("system_prompt")}
    return RecipeRun(recipe, related={"teachers": [teacher]}, renderer=renderer.name)


PROMPT_DISTILL = TrainingSpec(
    recipe="prompt_distill",
    library_config=PromptDistillConfig,
    ins={RESPONSES_ASSET: dg.AssetIn()},
    build=build_prompt_distill,
    defaults={"learning_rate": 5e-4, "lora_rank": 16},
    parent_assets=STUDENT_PARENTS,
    description="Prompt distillation: LoRA SFT of the student on teacher_responses (no system prompt); every saved "
    "checkpoint becomes a `prompt_distill_checkpoints` partition.",
)
prompt_distill_checkpoint = build_training_asset(PROMPT_DISTILL)
prompt_distill_checkpoints = build_checkpoints_asset(PROMPT_DISTILL)


def responses_prompts_asset(manifest: CheckpointManifest) -> str:
    """The prompts table the teacher answered for this checkpoint's teacher_responses version."""
    recorded = manifest.upstream.get(RESPONSES_ASSET, {}).get("metadata", {})
    return str(recorded.get("prompts_asset") or PROBLEMS_ASSET)


def prompt_distill_evaluators(inputs: EvalInputs) -> list:
    """Held-out agreement with the teacher's answers; with gold answers (an rl_problems table), task accuracy on
    the held-out prompts of the prompts version the teacher answered (the manifest's, never the latest)."""
    config, manifest = inputs.config, inputs.manifest
    agreement = agreement_problems(inputs.tables[RESPONSES_ASSET].to_pylist(), config.max_problems)
    if not agreement:
        raise dg.Failure(f"{manifest.partition} was trained on data with no held-out prompts: "
                         "materialize its prompts table with heldout_fraction > 0, then teacher_responses")
    renderer = get_renderer(manifest.renderer or "chatml", inputs.tokenizer)
    evaluators: list = [AgreementEvaluator(renderer, agreement, max_tokens=config.max_tokens, seed=config.seed)]
    prompts = inputs.tables[responses_prompts_asset(manifest)]
    if has_gold_answers(prompts):  # chat and comparison prompts have none
        problems = problems_from_table(prompts, split=HELDOUT_SPLIT, limit=config.max_problems or None)
        evaluators.append(AccuracyEvaluator(renderer, problems, prefix="", max_tokens=config.max_tokens, seed=config.seed))
    return evaluators


PROMPT_DISTILL_EVAL = EvalSpec(
    training=PROMPT_DISTILL, data_assets=(RESPONSES_ASSET, *PROMPT_ASSETS), evaluators=prompt_distill_evaluators,
    score_metric="agreement",
)
prompt_distill_eval_report = build_eval_asset(PROMPT_DISTILL_EVAL)

DISTILL_DATA_ASSETS = ("base_model", PROBLEMS_ASSET)
PROMPT_DISTILL_DATA_ASSETS = ("base_model", PROBLEMS_ASSET, RESPONSES_ASSET)  # the prompts table by default: rl_problems
DISTILL_ASSETS = (distill_checkpoint, distill_checkpoints, distill_eval_report, teacher_responses,
                  prompt_distill_checkpoint, prompt_distill_checkpoints, prompt_distill_eval_report)
