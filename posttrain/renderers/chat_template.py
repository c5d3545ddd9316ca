"""``chat_template``: the chat format a model ships in its tokenizer's own template, for families no renderer here
names (Gemma, Mistral, Phi-3, Granite, Cohere, OLMo, ...).

A chat template is a program (Jinja), not a format: it may number turns, move the system prompt, rewrite earlier
turns. What a renderer needs is a format: each message as a header, its content and what follows, the same
wherever it sits. :class:`TemplateFormat` reads that format from the template by rendering a few conversations of
sentinel contents (``tokenizer.apply_chat_template(..., tokenize=False)``) and cutting them where the sentinels
are, then renders other probe conversations with it and compares them with the template's own renderings: their
text, then their tokens (a content is encoded on its own, as every renderer here encodes it). A template that is not such a format is refused when the renderer is built, naming the probe it
renders otherwise, so a model is never trained on a format its template does not write.

What the template writes before the first message (a BOS, a default system prompt) is the first message's
header. An assistant message is trained on its content and the template's end-of-turn token (the first special
token after the content: ``<end_of_turn>``, ``</s>``, ``<|im_end|>``), which is also the stop token; what follows
it (a newline) is context. A template that strips the content of surrounding whitespace is followed. Thinking
parts and tool calls are refused (a named renderer handles the families that have them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.renderers.base import (
    Piece,
    RenderContext,
    RenderedMessage,
    Renderer,
    content,
    parse_for_stop_token,
    template,
)
from posttrain.renderers.types import Message, ParseTermination, RendererError, TrainOnWhat

_SENTINELS = {"system": "Sys7Sentinel", "user": "User7Sentinel", "user2": "Next7Sentinel", "assistant": "Asst7Sentinel"}


@dataclass(frozen=True)
class TemplateFormat:
    """A chat template as a per-role format (texts are template text: special tokens recognised)."""

    preamble: str  # before the first message when it is not a system message (a BOS, a default system prompt)
    system_preamble: str | None  # before a system message (always first); None: the template has no system role
    headers: dict[str, str]  # role -> its header (the assistant's is the generation prompt)
    endings: dict[str, str]  # role -> what follows its content (the assistant's: end-of-turn token, then context)
    stop: str  # the assistant's end-of-turn token
    strips: bool  # the template strips each content of surrounding whitespace
    closing: str = ""  # written after a finished conversation, not before a generation prompt (Phi-3's EOS)
    leads: dict[str, str] = field(default_factory=dict)  # role -> spaces its header ends with, kept with the content
    generation_prompt: str = ""  # what the template itself writes for add_generation_prompt


def read_format(tokenizer: Any) -> TemplateFormat:
    """The format of ``tokenizer``'s chat template, or :class:`RendererError` where even the sentinel
    conversations show it is not one (:class:`ChatTemplateRenderer` checks it on other conversations)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RendererError("renderer 'chat_template' needs a tokenizer with a chat template; this one has none")
    s, u, u2, a = (_SENTINELS[key] for key in ("system", "user", "user2", "assistant"))

    def render(messages: list[tuple[str, str]], generation: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template([{"role": role, "content": text} for role, text in messages],
                                                 tokenize=False, add_generation_prompt=generation)
        except Exception as error:  # noqa: BLE001 (templates raise anything: jinja's own exception, ValueError)
            raise RendererError(f"the chat template cannot render {[role for role, _ in messages]}: {error}") from error

    closing = _closing(tokenizer, render([("user", u)]), render([("user", u)], generation=True))

    def body(messages: list[tuple[str, str]], generation: bool = False) -> str:
        """A rendering without what the template writes only after a finished conversation (``closing``)."""
        text = render(messages, generation)
        if generation or not closing:
            return text
        _require(text.endswith(closing), f"it ends a conversation with {text[-len(closing):]!r}, not {closing!r}")
        return text[:-len(closing)]

    one, prompt = body([("user", u)]), body([("user", u)], generation=True)
    answered = body([("user", u), ("assistant", a)])
    two = body([("user", u), ("assistant", a), ("user", u2)])
    _require(prompt.startswith(one) and answered.startswith(prompt) and two.startswith(answered),
             "each turn's rendering is not a prefix of the next's (the template rewrites earlier turns)")
    _require(a in answered[len(prompt):], "the answer's content is not in its rendering")
    # what the template writes before an answer beyond its generation prompt (Mistral's ' ') is the answer's
    assistant_header = prompt[len(one):] + answered[len(prompt):answered.index(a, len(prompt))]
    assistant_ending = answered[answered.index(a, len(prompt)) + len(a):]
    user_header = two[len(answered):two.index(u2)]
    user_ending = two[two.index(u2) + len(u2):]
    _require(one.endswith(user_ending) and one[:one.index(u)].endswith(user_header),
             "the first user message is written otherwise than later ones")
    preamble = one[:one.index(u) - len(user_header)]
    stop = _end_of_turn(tokenizer, assistant_ending)
    system_preamble = system_header = system_ending = None
    try:
        with_system = body([("system", s), ("user", u)])
    except RendererError:
        with_system = None
    # A system role only where the template writes a system message as a message of its own, first (Gemma 3's
    # folds it into the first user turn, Mistral's drops it): elsewhere a system message is refused when rendered.
    if with_system is not None and s in with_system and u in with_system:
        start, end = with_system.index(s), with_system.index(u)
        between = with_system[start + len(s):end]
        if start < end and between.endswith(user_header) and with_system.endswith(user_ending):
            system_preamble, system_header = "", with_system[:start]
            system_ending = between[:len(between) - len(user_header)]
    stripped = render([("user", f" {u} ")])
    strips = f" {u} " not in stripped and u in stripped
    headers = {"user": user_header, "assistant": assistant_header}
    endings = {"user": user_ending, "assistant": assistant_ending}
    if system_header is not None:
        headers["system"], endings["system"] = system_header, system_ending
    # A header's closing spaces (Mistral's "[INST] ", its answers' " ") go with the content: a BPE tokenizer
    # joins a space to the word after it, as the template's tokenization of the whole string does, and a
    # generation prompt without them leaves the answer's first token (" Hello") to the model.
    leads = {role: header[len(header.rstrip(" ")):] for role, header in headers.items()}
    headers = {role: header.rstrip(" ") for role, header in headers.items()}
    return TemplateFormat(preamble, system_preamble, headers, endings, stop, strips, closing, leads,
                          generation_prompt=prompt[len(one):])


def _closing(tokenizer: Any, finished: str, prompted: str) -> str:
    """What a template writes after a finished conversation and not before a generation prompt (Phi-3's EOS):
    a special token ``finished`` ends with, after which it is a prefix of ``prompted``; empty for most."""
    if prompted.startswith(finished):
        return ""
    for token in _specials(tokenizer):
        if finished.endswith(token) and prompted.startswith(finished[:-len(token)]):
            return token
    _require(False, "each turn's rendering is not a prefix of the next's (the template rewrites earlier turns)")
    return ""


def _specials(tokenizer: Any) -> list[str]:
    """The tokenizer's special and added tokens' texts, longest first."""
    return sorted({str(token) for token in getattr(tokenizer, "all_special_tokens", [])}
                  | {str(token) for token in getattr(tokenizer, "added_tokens_encoder", {})} - {""},
                  key=len, reverse=True)


def _header(found: TemplateFormat, role: str, index: int) -> str:
    if role not in found.headers:
        raise RendererError(f"this model's chat template has no {role!r} role")
    if index:
        return found.headers[role]
    return (found.system_preamble if role == "system" else found.preamble) + found.headers[role]


def _end_of_turn(tokenizer: Any, ending: str) -> str:
    """The end-of-turn token's text of an assistant message's ending (the first special token in it)."""
    first = min(((ending.find(token), token) for token in _specials(tokenizer) if token in ending), default=None)
    if first is None:
        raise RendererError(f"the template ends an answer with {ending!r}, which holds no special token to stop at")
    position, token = first
    _require(not ending[:position].strip(), f"the template writes {ending[:position]!r} between an answer and its "
                                             "end-of-turn token")
    return token


def _probes(system: bool) -> list[tuple[list[Message], bool]]:
    """Conversations the format must render as the template does (an answer starting in lower case: a header
    that runs into its content then tokenizes otherwise, which the text alone would not show)."""
    chat: list[Message] = [{"role": "user", "content": "What is 2 + 3?"},
                           {"role": "assistant", "content": "sure, 2 + 3 = 5.\nAnything else?"},
                           {"role": "user", "content": "No, thanks!"},
                           {"role": "assistant", "content": "Bye."}]
    probes = [(chat[:2], False), (chat[:3], True), (chat, False)]
    if system:
        probes += [([{"role": "system", "content": "Be brief."}, *chat[:3]], True)]
    return probes


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise RendererError(f"renderer 'chat_template' cannot read this tokenizer's chat template: {reason}. "
                            "Choose a renderer by name instead.")


class ChatTemplateRenderer(Renderer):
    """The tokenizer's own chat template as a renderer (module docstring)."""

    name = "chat_template"
    prompt_is_rendered_history = True

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.format = read_format(tokenizer)
        stop = self.encode_template(self.format.stop)
        if len(stop) != 1:
            raise RendererError(f"the chat template's end-of-turn {self.format.stop!r} is not one token")
        self._stop_token = stop[0]
        self._check(tokenizer)

    def _check(self, tokenizer: Any) -> None:
        """The probe conversations, rendered from this renderer's own pieces, against the template: text, then
        tokens. A generation prompt is ours where it adds what the template writes before an answer (Mistral's
        template has no generation prompt; its answers follow a space, which goes with the answer's content)."""
        found = self.format
        for messages, generation in _probes(found.system_preamble is not None):
            roles = [m["role"] for m in messages]
            theirs = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            if generation:
                _require(theirs.endswith(found.generation_prompt), "its generation prompt depends on the conversation")
                theirs = theirs[:len(theirs) - len(found.generation_prompt)] + found.headers["assistant"]
                pieces = self.generation_plan(messages)
            else:
                pieces = self.supervised_plan(messages, TrainOnWhat.ALL_MESSAGES).pieces
            ours = "".join(piece.text for piece in pieces)
            _require(ours == theirs, f"it renders {roles} otherwise than a per-role format: {theirs!r} where the "
                                     f"format reads {ours!r}")
            tokens = [token for piece_tokens in self._encode_one_by_one(pieces) for token in piece_tokens]
            _require(tokens == self.codec.encode_template(theirs), f"its tokens for {roles} differ from the "
                     "template's (a tokenizer that marks word starts, as SentencePiece's '▁', at each piece?)")

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        role, text = message["role"], message["content"]
        if not isinstance(text, str) or message.get("tool_calls") or role not in ("system", "user", "assistant"):
            raise RendererError(f"{self.name} renders plain-text system, user and assistant messages (message "
                                f"{ctx.idx} is a {role!r} message with thinking parts or tool calls)")
        if role == "system" and ctx.idx:
            raise RendererError(f"{self.name}: a system message comes first (message {ctx.idx} is one)")
        header = [template(_header(self.format, role, ctx.idx))]
        body = self.format.leads.get(role, "") + (text.strip() if self.format.strips else text)
        ending = self.format.endings[role]
        # trained up to the end-of-turn token where the ending starts with it (an assistant's always does)
        cut = len(self.format.stop) if ending.lstrip().startswith(self.format.stop) else 0
        cut += len(ending) - len(ending.lstrip()) if cut else 0
        closing = self.format.closing if ctx.is_last and not ctx.in_prompt else ""
        return RenderedMessage(header=header, output=[content(body), template(ending[:cut])],
                               trailer=[template(ending[cut:] + closing)])

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[Piece]:
        return [template(_header(self.format, role, ctx.idx))]

    def get_stop_sequences(self) -> list[int]:
        return [self._stop_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        text, termination = parse_for_stop_token(tokens, self.codec, self._stop_token)
        return {"role": "assistant", "content": text.removeprefix(self.format.leads.get("assistant", ""))}, termination
