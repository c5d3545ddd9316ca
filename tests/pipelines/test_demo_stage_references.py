"""`stage:<name>` in a demo stage's config names the checkpoint an earlier stage of that name trained.

The RLHF stage set has two SFT stages (a strong one that trains and guides the judge, a weak parent that RLHF
refines), which `latest:sft` cannot tell apart; the chain run's demo-stage tag can.
"""

from __future__ import annotations

import pytest

from pipelines.demo import (
    DEMO_STAGE_TAG,
    STAGE_SETS,
    DemoStage,
    resolve_stage_references,
    stage_checkpoint,
    stage_ops,
)


def test_stage_references_are_replaced_wherever_they_sit_in_the_config():
    config = {"op": {"config": {"init_from": "stage:strong", "judge": {"reference_from": "stage:weak"}, "steps": 3,
                                "sampler": "latest:sft", "note": "a stage: not a reference"}}}
    found = resolve_stage_references(config, lambda name: f"checkpoint-of-{name}")
    assert found == {"op": {"config": {"init_from": "checkpoint-of-strong", "judge": {"reference_from": "checkpoint-of-weak"},
                                       "steps": 3, "sampler": "latest:sft", "note": "a stage: not a reference"}}}
    assert config["op"]["config"]["init_from"] == "stage:strong"  # the stage's own config is left as it was


def test_every_stage_reference_of_the_rlhf_set_names_an_earlier_stage_of_the_set():
    earlier: list[str] = []
    for stage in STAGE_SETS["rlhf"]:
        named: list[str] = []
        resolve_stage_references(stage.run_config, lambda name: named.append(name) or name)
        assert set(named) <= set(earlier), f"{stage.label} names {named}, runs after {earlier}"
        earlier.append(stage.label)
    labels = [stage.label for stage in STAGE_SETS["rlhf"]]
    assert len(set(labels)) == len(labels)  # a stage name names one stage
    # RLHF refines the weak parent; the judge learns from the weak parent's answers, starts from the strong SFT,
    # which also writes its references.
    rlhf = STAGE_SETS["rlhf"][-1].run_config["rlhf_checkpoint"]["config"]
    assert (rlhf["init_from"], rlhf["judge_reference_from"]) == ("stage:sft_parent", "stage:sft")
    judge = STAGE_SETS["rlhf"][-2].run_config
    assert judge["onpolicy_comparisons"]["config"]["sampler"] == "stage:sft_parent"
    assert judge["preference_model_checkpoint"]["config"]["init_from"] == "stage:sft"


def test_a_stage_reference_resolves_to_the_final_checkpoint_of_that_stages_newest_run(sft_pipeline_run):
    run = sft_pipeline_run
    run.instance.add_run_tags(run.chain.run_id, {DEMO_STAGE_TAG: "strong_sft"})
    final = run.requested_partitions[-1]
    assert stage_checkpoint(run.instance, "strong_sft") == final

    stage = DemoStage("rlhf", {"rlhf_checkpoint": {"config": {"init_from": "stage:strong_sft", "judge_reference_from": "stage:strong_sft"}}})
    ops = stage_ops(run.instance, stage, {"rlhf_checkpoint": {"init_from": "sft-explicit-000001"}})
    # An override replaces the reference before it is looked up; the rest resolve.
    assert ops == {"rlhf_checkpoint": {"config": {"init_from": "sft-explicit-000001", "judge_reference_from": final}}}


def test_a_stage_that_never_ran_is_named_with_what_to_do(sft_pipeline_run):
    with pytest.raises(LookupError, match=r"stage:sft_parent names the demo stage 'sft_parent', which has no checkpoint.*scripts/demo_stage.py sft_parent"):
        stage_checkpoint(sft_pipeline_run.instance, "sft_parent")
