"""chat_template: a tokenizer's own chat template as a renderer, for families no renderer names. On SmolLM2's
template it is the hand-written smollm2 renderer token for token and weight for weight; on templates of Gemma's,
Mistral's and Phi-3's shapes (written here after the hub's: a renamed role, stripped contents, no system role, a
BOS, an end-of-turn token that is the EOS, no generation prompt, an EOS after a finished conversation only) it renders what the template renders and trains the answer up to its
end-of-turn token; a template that is not a per-role format is refused when the renderer is built."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from posttrain.renderers import ParseTermination, TrainOnWhat, get_renderer
from posttrain.renderers.registry import resolve_renderer_name
from posttrain.renderers.types import RendererError
from tests.posttrain.renderers.conversations import plain_corpus
from tests.posttrain.renderers.test_chatml import _template_safe, _template_tokens

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
         "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")
PHI3 = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
NUMBERED = "{% for m in messages %}{{ loop.index ~ '. ' ~ m['role'] ~ ': ' ~ m['content'] ~ '<|im_end|>' }}{% endfor %}"
GLUED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + m['content'] + '<|im_end|>' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}")
SPECIALS = {"gemma": ["<start_of_turn>", "<end_of_turn>"], "mistral": [], "phi3": ["<|user|>", "<|assistant|>",
                                                                                    "<|system|>", "<|end|>"]}


@pytest.fixture(scope="module")
def conversations():
    return [c for c in plain_corpus(seed=7, size=80) if _template_safe(c)]


def _tokenizer(smollm2_dir, chat_template: str, specials: list[str]):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = chat_template
    return tokenizer


def test_on_smollm2s_template_it_is_the_smollm2_renderer(smollm2_tokenizer, conversations):
    ours, theirs = get_renderer("chat_template", smollm2_tokenizer), get_renderer("smollm2", smollm2_tokenizer)
    assert len(conversations) > 30
    for conversation in conversations:
        for mode in (TrainOnWhat.LAST_ASSISTANT_MESSAGE, TrainOnWhat.ALL_ASSISTANT_MESSAGES, TrainOnWhat.ALL_MESSAGES):
            tokens, weights = ours.build_supervised_example(conversation, mode)
            expected_tokens, expected_weights = theirs.build_supervised_example(conversation, mode)
            assert tokens.to_ints() == expected_tokens.to_ints()
            np.testing.assert_array_equal(weights, expected_weights)
        assert ours.build_generation_prompt(conversation[:-1]).to_ints() == \
            theirs.build_generation_prompt(conversation[:-1]).to_ints()
    assert ours.get_stop_sequences() == theirs.get_stop_sequences()


@pytest.mark.parametrize("family", ["gemma", "mistral", "phi3"])
def test_it_renders_what_the_template_renders_and_trains_the_answer_to_its_end_of_turn(family, smollm2_dir,
                                                                                       conversations):
    tokenizer = _tokenizer(smollm2_dir, {"gemma": GEMMA, "mistral": MISTRAL, "phi3": PHI3}[family], SPECIALS[family])
    renderer = get_renderer("chat_template", tokenizer)
    stop = {"gemma": "<end_of_turn>", "mistral": tokenizer.eos_token, "phi3": "<|end|>"}[family]
    assert renderer.get_stop_sequences() == tokenizer.convert_tokens_to_ids([stop])
    plain = [c for c in conversations if c[0]["role"] != "system"]
    assert len(plain) > 10
    for conversation in plain:
        tokens, weights = renderer.build_supervised_example(conversation)
        assert tokens.to_ints() == _template_tokens(tokenizer, conversation)  # Phi-3's closing EOS included
        prompt = renderer.build_generation_prompt(conversation[:-1]).to_ints()
        # (Mistral's template has no generation prompt: an answer follows [/INST] and a space, the answer's own)
        assert prompt == _template_tokens(tokenizer, conversation[:-1], add_generation_prompt=True)
        assert tokens.to_ints()[:len(prompt)] == prompt
        trained = [t for t, w in zip(tokens.to_ints(), weights) if w > 0]
        answer = conversation[-1]["content"]
        answer = {"gemma": answer.strip(), "mistral": " " + answer, "phi3": answer}[family]
        assert trained == renderer.codec.encode_content(answer) + renderer.get_stop_sequences()
        parsed, termination = renderer.parse_response(trained)
        assert termination == ParseTermination.STOP_SEQUENCE
        assert parsed["content"] == conversation[-1]["content"].strip() if family == "gemma" else conversation[-1]["content"]


GEMMA3_SYSTEM = GEMMA.replace(
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set prefix = '' %}{% endif %}").replace(
    "message['content'] | trim", "(prefix if loop.first else '') + message['content'] | trim")


def test_a_system_message_the_template_cannot_write_is_refused_not_dropped(smollm2_dir):
    """Mistral's template (as here) silently drops a system message, Gemma 2's raises, Gemma 3's folds it into
    the first user turn: none writes a system message of its own. Conversations without one render as the
    template does; one with it is refused."""
    for chat_template, specials in ((MISTRAL, []), (GEMMA, SPECIALS["gemma"]), (GEMMA3_SYSTEM, SPECIALS["gemma"])):
        renderer = get_renderer("chat_template", _tokenizer(smollm2_dir, chat_template, specials))
        tokenizer = renderer.tokenizer
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
        assert renderer.build_supervised_example(chat)[0].to_ints() == _template_tokens(tokenizer, chat)
        with pytest.raises(RendererError, match="has no 'system' role"):
            renderer.build_supervised_example([{"role": "system", "content": "Be brief."}, *chat])


def test_a_template_that_is_not_a_per_role_format_is_refused_when_built(smollm2_dir):
    tokenizer = _tokenizer(smollm2_dir, NUMBERED, [])
    with pytest.raises(RendererError, match="cannot read this tokenizer's chat template.*Choose a renderer by name"):
        get_renderer("chat_template", tokenizer)
    tokenizer.chat_template = GLUED  # a per-role format in text, but a content's first word merges with its header
    with pytest.raises(RendererError, match=r"its tokens for \['user', 'assistant'\] differ from the template's"):
        get_renderer("chat_template", tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(RendererError, match="needs a tokenizer with a chat template"):
        get_renderer("chat_template", tokenizer)


def test_auto_falls_back_to_the_tokenizers_own_template(smollm2_dir, smollm2_tokenizer, monkeypatch):
    """A family auto does not know by name or control tokens gets its own template; one it knows keeps its
    renderer. (This tokenizer is SmolLM2's, whose ChatML markers the control-token rule would find: that rule
    is told to find nothing, as for a real Gemma tokenizer.)"""
    from posttrain.renderers import registry

    gemma = _tokenizer(smollm2_dir, GEMMA, SPECIALS["gemma"])
    monkeypatch.setattr(registry, "renderer_for_tokenizer", lambda tokenizer: None)
    assert resolve_renderer_name("auto", "google/gemma-3-1b-it", gemma) == "chat_template"
    assert get_renderer("auto", gemma, base_model="/models/my-gemma").name == "chat_template"
    assert resolve_renderer_name("auto", "HuggingFaceTB/SmolLM2-135M-Instruct", smollm2_tokenizer) == "chatml"
