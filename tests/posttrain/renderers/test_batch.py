"""render_supervised_batch: identical rows to the per-example path, faster, arrow-ready."""

from __future__ import annotations

import pyarrow as pa
import pytest

from posttrain.renderers import RendererError, TrainOnWhat, get_renderer
from posttrain.renderers.batch import render_supervised_batch
from tests.posttrain.renderers.conversations import corpus, plain_corpus


def _assert_rows_match(renderer, conversations, train_on_what, batch, max_length=None):
    assert batch.row_index == list(range(len(conversations)))
    for row, conversation in enumerate(conversations):
        model_input, weights = renderer.build_supervised_example(conversation, train_on_what)
        tokens = model_input.to_ints()
        assert batch.original_num_tokens[row] == len(tokens)
        if max_length is not None:
            tokens, weights = tokens[:max_length], weights[:max_length]
        assert batch.tokens[row] == tokens, f"row {row}"
        assert batch.weights[row].tolist() == weights.tolist(), f"row {row} weights"


@pytest.mark.parametrize("train_on_what", [TrainOnWhat.LAST_ASSISTANT_MESSAGE, TrainOnWhat.ALL_MESSAGES, TrainOnWhat.ALL_TOKENS])
def test_chatml_batch_equals_per_example(smollm2_tokenizer, train_on_what):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    conversations = plain_corpus(seed=3, size=60)
    batch = render_supervised_batch(renderer, conversations, train_on_what)
    _assert_rows_match(renderer, conversations, train_on_what, batch)


@pytest.mark.parametrize(
    ("name", "tokenizer_fixture", "options"),
    [
        ("qwen3", "qwen3_tokenizer", {"reasoning": "all"}),
        ("qwen3_disable_thinking", "qwen3_tokenizer", {"reasoning": "history"}),
        ("deepseekv3_thinking", "deepseek_tokenizer", {"reasoning": "all", "systems": 2}),
    ],
)
def test_reasoning_and_tool_formats_batch_equals_per_example(name, tokenizer_fixture, options, request):
    renderer = get_renderer(name, request.getfixturevalue(tokenizer_fixture))
    conversations = corpus(seed=4, size=40, **options)
    batch = render_supervised_batch(renderer, conversations, TrainOnWhat.LAST_ASSISTANT_MESSAGE, max_length=64)
    _assert_rows_match(renderer, conversations, TrainOnWhat.LAST_ASSISTANT_MESSAGE, batch, max_length=64)
    assert any(batch.truncated) and not all(batch.truncated)
    assert all(len(row) <= 64 for row in batch.tokens)


def test_tml_renderers_take_the_per_example_path(tml_renderer):
    renderer = tml_renderer("qwen3")
    conversations = corpus(seed=6, size=8, reasoning="all")
    batch = render_supervised_batch(renderer, conversations)
    _assert_rows_match(renderer, conversations, TrainOnWhat.LAST_ASSISTANT_MESSAGE, batch)


def test_bad_rows_raise_with_their_index_or_are_skipped(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    conversations = plain_corpus(seed=8, size=5)
    conversations[2] = [{"role": "user", "content": 42}, {"role": "assistant", "content": "x"}]
    conversations[4] = [{"content": "no role"}]
    with pytest.raises(RendererError, match="conversation 2: message 0: 'content' must be a string"):
        render_supervised_batch(renderer, conversations)
    batch = render_supervised_batch(renderer, conversations, errors="skip")
    assert batch.row_index == [0, 1, 3]
    assert [index for index, _ in batch.skipped] == [2, 4]
    assert "role" in batch.skipped[1][1]


def test_columns_and_arrow_table(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    batch = render_supervised_batch(renderer, plain_corpus(seed=9, size=10), max_length=40)
    table = batch.to_arrow()
    assert table.num_rows == 10
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("weights").type == pa.list_(pa.float32())
    columns = batch.columns()
    for row in range(10):
        assert columns["num_tokens"][row] == len(columns["tokens"][row]) == len(columns["weights"][row])
        assert columns["num_trained_tokens"][row] == sum(1 for w in columns["weights"][row] if w > 0)
        assert columns["truncated"][row] == (columns["original_num_tokens"][row] > 40)
    assert table.column("tokens").to_pylist() == columns["tokens"]


def test_word_cache_falls_back_to_the_tokenizer_when_a_spot_check_disagrees(smollm2_tokenizer):
    from posttrain.renderers.codec import HuggingFaceCodec

    codec = HuggingFaceCodec(smollm2_tokenizer)
    texts = [message["content"] for conversation in plain_corpus(seed=12, size=20) for message in conversation]
    exact = [codec.encode_content(text) for text in texts]  # the tokenizer itself, one string at a time
    assert codec.encode_content_batch(texts) == exact
    codec._words.encode_many = lambda batch: [[0] for _ in batch]  # a broken cache
    assert codec.encode_content_batch(texts) == exact
    assert codec._words is None


def _tricky_texts(seed: int, count: int) -> list[str]:
    """Texts built to break a split at spaces: contractions, digits, punctuation next to spaces, non-Latin
    scripts, combining marks (NFC), and every kind of whitespace run (double, leading, trailing, newline,
    tab, no-break and ideographic spaces) — most texts have none, as in real data."""
    import random

    rng = random.Random(seed)
    words = ["it's", "we'll", "I'M", "don't", "3.14", "12345", "x+y", "(a)", "--", "...", "café", "cafe\u0301",
             "naïve", "世界", "数据", "Привет", "😀", "'s", "'", "a'b", "<|im_end|>", "foo_bar", "1st", "?!"]
    spaces = ["  ", "   ", "\n", " \n", "\n ", "\t", "\u00a0", "\u3000", " \n\n "]
    texts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.3:
            cut = rng.randrange(len(text) + 1)
            text = text[:cut] + rng.choice(spaces) + text[cut:]
        if rng.random() < 0.1:
            text = rng.choice([" ", "\n"]) + text if rng.random() < 0.5 else text + rng.choice([" ", "\n"])
        texts.append(text)
    return texts + ["", " ", "  ", "\n", "a", " a", "a "]


@pytest.mark.parametrize("tokenizer_fixture", ["smollm2_tokenizer", "qwen3_tokenizer"])
def test_word_cache_with_its_space_split_equals_the_tokenizer_on_every_text(tokenizer_fixture, request):
    from posttrain.renderers.codec import HuggingFaceCodec

    codec = HuggingFaceCodec(request.getfixturevalue(tokenizer_fixture))
    assert codec._words is not None and codec._words._space_separable
    texts = _tricky_texts(seed=13, count=600)
    for attempt in range(2):  # cold, then every run and word cached
        encoded = codec._words.encode_many(texts)  # the cache itself, not the spot-checked wrapper
        for text, ids in zip(texts, encoded, strict=True):
            assert ids == codec.encode_content(text), f"{text!r} (pass {attempt})"
    assert " it's" in codec._words._runs and len(codec._words._runs) > 30  # the space split did the work
