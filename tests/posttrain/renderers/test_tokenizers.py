"""The offline Qwen3 tokenizer equals tml-renderers' native one; DeepSeek's comes from tml-renderers."""

from __future__ import annotations

from posttrain.renderers.codec import TmlCodec, as_codec
from posttrain.renderers.tokenizers import QWEN3_ADDED_TOKENS, QWEN3_FIRST_ADDED_ID
from tests.posttrain.renderers.conversations import REASONINGS, TEXTS


def test_qwen3_ids_equal_tml_renderers(qwen3_tokenizer):
    from tml_renderers.tokenizers import Qwen3Tokenizer

    native = Qwen3Tokenizer()
    codec = as_codec(qwen3_tokenizer)
    texts = list(TEXTS + REASONINGS) + ["Ǆ ﬁ Å Ω ﾊﾝｶｸ", "\r\n\r\n\t x", "x" * 300, "1234567890"]
    assert codec.encode_content_batch(texts) == [native.encode_ordinary(text) for text in texts]
    for text in texts:
        assert codec.decode(codec.encode_content(text)) == native.decode(native.encode_ordinary(text))
    native_special = {native.decode([native.encode_special(name)]): native.encode_special(name) for name in native.special_tokens()}
    for offset, (text, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert qwen3_tokenizer.convert_tokens_to_ids(text) == QWEN3_FIRST_ADDED_ID + offset == native_special[text]


def test_qwen3_marks_think_and_tool_tokens_ordinary(qwen3_tokenizer):
    decoder = qwen3_tokenizer.added_tokens_decoder
    special = {token.content: token.special for token in decoder.values()}
    assert special["<|im_end|>"] and special["<|im_start|>"] and special["<|endoftext|>"]
    for ordinary in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert special[ordinary] is False
    # the plain tokenizer still recognises them; our content encoding does not
    assert qwen3_tokenizer("<think>", add_special_tokens=False)["input_ids"] == [151667]
    assert len(as_codec(qwen3_tokenizer).encode_content("<think>")) > 1


def test_deepseek_tokenizer_is_tml_renderers(deepseek_tokenizer):
    codec = as_codec(deepseek_tokenizer)
    assert isinstance(codec, TmlCodec)
    assert codec.encode_template("<｜User｜>hi<｜Assistant｜></think>") == [
        deepseek_tokenizer.encode_special("User"),
        *deepseek_tokenizer.encode_ordinary("hi"),
        deepseek_tokenizer.encode_special("Assistant"),
        deepseek_tokenizer.encode_special("</think>"),
    ]
    assert codec.bos_text == "<｜begin▁of▁sentence｜>" and codec.eos_token_id == 1
