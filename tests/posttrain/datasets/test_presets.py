"""Every preset loads its real hub layout and schema through datasets.load_dataset, offline."""

from __future__ import annotations

import json

import pytest

from posttrain.datasets import schemas
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.sources import SourceNotFoundError


def rows(kind: str, source: str, **kwargs) -> list[dict]:
    return load(LoadSpec(kind, source, **kwargs)).table.to_pylist()


def test_no_robots_keeps_system_and_multi_turn(hub_mirror):
    loaded = load(LoadSpec("chat", "no_robots"))
    assert loaded.table.schema.equals(schemas.CHAT)
    table = loaded.table.to_pylist()
    assert [r["row_id"] for r in table] == ["no_robots/train/0", "no_robots/train/1", "no_robots/train/2"]
    assert [m["role"] for m in table[1]["messages"]] == ["system", "user", "assistant"]
    assert [m["content"] for m in table[2]["messages"]] == ["Name a prime number.", "7", "Another?", "11"]
    test_rows = rows("chat", "HuggingFaceH4/no_robots", split="test")
    assert [m["content"] for m in test_rows[0]["messages"]] == ["Say hi.", "Hi!"]


def test_tulu3_by_hub_id(hub_mirror):
    table = rows("chat", "allenai/tulu-3-sft-mixture")
    assert table[0]["messages"][-1] == {"role": "assistant", "content": "Katze"}
    assert table[0]["source"] == "tulu3_sft"


def test_hh_rlhf_transcripts_split_into_shared_prompt(hub_mirror):
    table = rows("comparison", "hh_rlhf")
    multi = next(r for r in table if len(r["prompt"]) > 1)
    assert multi["prompt"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fact."},
    ]
    assert multi["chosen"] == [{"role": "assistant", "content": "Octopuses have three hearts."}]
    assert multi["rejected"] == [{"role": "assistant", "content": "No."}]
    assert len(rows("comparison", "hhh", split="test")) == 1


def test_hhh_alignment_picks_label_one(hub_mirror):
    table = rows("comparison", "hhh_alignment")
    assert table[0]["chosen"][0]["content"].startswith("I can't help")
    assert table[1]["chosen"][0]["content"].startswith("Keep them in their original containers")


def test_ultrafeedback_uses_train_prefs(hub_mirror):
    table = rows("comparison", "HuggingFaceH4/ultrafeedback_binarized")
    assert table[0]["row_id"] == "ultrafeedback/train_prefs/0"
    assert table[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert (table[0]["chosen"][0]["content"], table[0]["rejected"][0]["content"]) == ("2 + 2 = 4.", "22")


def test_helpsteer3_direction_and_ties(hub_mirror):
    loaded = load(LoadSpec("comparison", "helpsteer3"))
    table = loaded.table.to_pylist()
    assert loaded.filtered == 1  # overall_preference 0
    assert table[0]["chosen"][0]["content"] == "A cat sat on a mat."  # -2: response1 better
    assert table[1]["chosen"][0]["content"] == "3*3 = 9."  # +3: response2 better
    assert [m["role"] for m in table[1]["prompt"]] == ["user", "assistant", "user"]


def test_gsm8k_gold_answer_and_chat_view(hub_mirror):
    problems = rows("rl", "gsm8k")
    assert [p["answer"] for p in problems] == ["7", "750", "1200"]
    assert problems[0]["scorer"] == "exact_number"
    assert json.loads(problems[0]["scorer_metadata"])["solution"].endswith("#### 7")
    chat = rows("chat", "openai/gsm8k")
    assert chat[0]["messages"][1]["content"].endswith("#### 7")


def test_deepcoder_configs_and_functional_tests(hub_mirror):
    lcb = rows("code", "deepcoder")
    assert lcb[0]["tests"] == [
        {"input": "1 2\n", "output": "3\n", "kind": "stdin"},
        {"input": "5 7\n", "output": "12\n", "kind": "stdin"},
    ]
    assert (lcb[1]["entry_point"], lcb[1]["tests"][0]["kind"]) == ("maxOf", "functional")
    prime = rows("code", "deepcoder", config_name="primeintellect")
    assert prime[0]["row_id"] == "deepcoder:primeintellect/train/0"
    assert prime[0]["tests"] == [{"input": "abc\n", "output": "cba\n", "kind": "stdin"}]


def test_livecodebench_public_tests(hub_mirror):
    table = rows("code", "livecodebench")
    assert table[0]["tests"] == [{"input": "4\n", "output": "8\n", "kind": "stdin"}]
    assert table[1]["entry_point"] == "sumList"
    assert table[1]["starter_code"].startswith("class Solution")


def test_preset_kind_mismatch_is_explained(hub_mirror):
    with pytest.raises(ValueError, match="holds comparison data and cannot be loaded as chat"):
        load(LoadSpec("chat", "hh_rlhf"))


def test_preset_read_from_explicit_local_copy(tmp_path, hub_mirror, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_HUB_MIRROR")
    table = rows("rl", "gsm8k", path=str(hub_mirror / "openai" / "gsm8k"))
    assert table[0]["answer"] == "7"


def test_missing_hub_dataset_offline_says_how_to_fix(hub_mirror):
    with pytest.raises(SourceNotFoundError, match="POSTTRAIN_HUB_MIRROR"):
        load(LoadSpec("chat", "someone/not-mirrored-dataset"))


@pytest.mark.parametrize("kind,source", [("chat", "no_robots"), ("comparison", "hh_rlhf"), ("comparison", "helpsteer3"), ("rl", "gsm8k")])
def test_limit_streams_the_same_first_rows(hub_mirror, kind, source):
    full = load(LoadSpec(kind, source)).table
    streamed = load(LoadSpec(kind, source, limit=2))
    assert streamed.table.num_rows + streamed.filtered == 2
    assert streamed.table.equals(full.slice(0, streamed.table.num_rows))


def test_missing_hub_dataset_with_limit_says_how_to_fix(hub_mirror):
    with pytest.raises(SourceNotFoundError, match="POSTTRAIN_HUB_MIRROR"):
        load(LoadSpec("chat", "someone/not-mirrored-dataset", limit=5))
