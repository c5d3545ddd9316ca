"""One encoding interface over Hugging Face tokenizers and tml-renderers' built-in tokenizers.

Renderers encode two kinds of text differently, and this is the one place that knows how:

- **template** text (``<|im_start|>user\\n``, ``<think>\\n``): special and added tokens are recognised,
  so ``<|im_end|>`` becomes the single end-of-turn token;
- **content** text (what a user or model wrote): encoded *literally*, as pure BPE with no added token
  recognised, so a message that mentions ``<|im_end|>`` cannot end a turn or smuggle in structure.
  This is tml-renderers' ``encode_ordinary`` and what a sampler sees when a model writes that text.

Content can be encoded in batches (one call for many strings), which is what makes dataset rendering
fast; the result equals encoding each string alone.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import regex
from tokenizers import Tokenizer as BackendTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

logger = logging.getLogger(__name__)
GPT2_PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Patterns under which a text whose only whitespace is single spaces between non-space runs splits
# exactly as its space-led runs split one by one: no alternative can take a space except as a match's
# first character, so no match crosses a space, and the only lookahead (``(?!\S)``) follows whitespace,
# which such a run has only at its start. (Tested against each tokenizer's own encoding.)
_SPACE_SEPARABLE_PATTERNS = frozenset({GPT2_PRETOKENIZE_PATTERN, QWEN2_PRETOKENIZE_PATTERN})
_SPOT_CHECKS = 48
_WORD_CACHE_LIMIT = 1_000_000


@runtime_checkable
class TokenCodec(Protocol):
    def encode_template(self, text: str) -> list[int]: ...

    def encode_content(self, text: str) -> list[int]: ...

    def encode_content_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    @property
    def bos_text(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...


def single_token_id(codec: TokenCodec, text: str, renderer: str) -> int:
    """The id of a one-token marker such as ``<|im_end|>``; a clear error when the tokenizer lacks it."""
    tokens = codec.encode_template(text)
    if len(tokens) != 1:
        raise ValueError(
            f"renderer {renderer!r} needs {text!r} to be a single token of its tokenizer, but it "
            f"encodes to {len(tokens)} tokens {tokens[:8]}: pass the tokenizer of a model that "
            "uses this chat format (or choose the renderer that matches your tokenizer)."
        )
    return tokens[0]


class HuggingFaceCodec:
    """Wraps a ``transformers`` fast tokenizer or a bare ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, BackendTokenizer):
            raise TypeError(
                f"expected a fast Hugging Face tokenizer, got {type(tokenizer).__name__}: load it "
                "with transformers.AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        self.tokenizer = tokenizer
        self._template = backend
        config = json.loads(backend.to_str())
        self._content = _literal_copy(config)
        self._words = WordCachedBPE.for_config(config, self._content)
        self._bos_text = getattr(tokenizer, "bos_token", None)
        self._eos_token_id = getattr(tokenizer, "eos_token_id", None)

    def encode_template(self, text: str) -> list[int]:
        return self._template.encode(text, add_special_tokens=False).ids

    def encode_content(self, text: str) -> list[int]:
        return self._content.encode(text, add_special_tokens=False).ids

    def encode_content_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many contents at once: through the word cache when the tokenizer allows it (spot-checked
        against the tokenizer itself), else one batched tokenizer call."""
        texts = list(texts)
        if self._words is not None:
            encoded = self._words.encode_many(texts)
            step = max(1, len(texts) // _SPOT_CHECKS)
            sample = list(range(0, len(texts), step))
            exact = self._content.encode_batch([texts[i] for i in sample], add_special_tokens=False)
            if all(encoded[i] == expected.ids for i, expected in zip(sample, exact, strict=True)):
                return encoded
            logger.warning("word-cached encoding disagreed with the tokenizer; using the tokenizer for this batch")
            self._words = None
        return [encoding.ids for encoding in self._content.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: Sequence[int]) -> str:
        return self._template.decode(list(tokens), skip_special_tokens=False)

    @property
    def bos_text(self) -> str | None:
        return self._bos_text

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id


def _literal_copy(config: dict) -> BackendTokenizer:
    """A private copy of a tokenizer (given as its JSON config) that matches no added token at all.

    ``encode_special_tokens`` only splits tokens marked special, and Qwen3's ``<think>`` is an
    ordinary added token, so the copy marks every added token special first. A copy (not a flag
    flipped on the shared tokenizer) keeps concurrent encodes from racing on that flag.
    """
    config = dict(config, added_tokens=[dict(added, special=True) for added in config.get("added_tokens", [])])
    literal = BackendTokenizer.from_str(json.dumps(config))
    literal.encode_special_tokens = True
    return literal


class WordCachedBPE:
    """Byte-level BPE content encoding with a word cache, for tokenizers where that is exact.

    A byte-level BPE tokenizer splits text with a regex and encodes every piece on its own, so a piece
    seen before (most of them, in a dataset) can reuse its ids. We split with the same regex, look the
    piece up, and only call the tokenizer's own BPE model for unseen pieces. Used only when the
    tokenizer is exactly [optional NFC] + regex split + byte-level + BPE; callers spot-check it.

    Under the usual patterns (``_SPACE_SEPARABLE_PATTERNS``) most texts need no regex at all: when a
    text's only whitespace is single spaces between words, ``str.split(" ")`` cuts it where the regex
    would also cut, and each space-led run (``" word,"``) is looked up whole. The regex was most of
    the content encoding time of a large dataset (docs/benchmarks.md).
    """

    def __init__(self, model: Any, pattern: str, nfc: bool):
        self._model = model
        self._split = regex.compile(pattern).findall
        self._space_separable = pattern in _SPACE_SEPARABLE_PATTERNS
        self._nfc = nfc
        self._byte_chars = [bytes_to_unicode()[byte] for byte in range(256)]
        self._cache: dict[str, list[int]] = {}
        self._runs: dict[str, list[int]] = {}  # a whole space-led run (or a text's first run) -> its ids

    @classmethod
    def for_config(cls, config: dict, backend: BackendTokenizer) -> WordCachedBPE | None:
        """The word cache for ``backend`` (whose JSON config is ``config``), or None when not exact."""
        normalizer, pre, model = config.get("normalizer"), config.get("pre_tokenizer") or {}, config.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback") or normalizer not in (None, {"type": "NFC"}):
            return None
        if pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space"):
            pattern = GPT2_PRETOKENIZE_PATTERN
        elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
            split, byte_level = pre["pretokenizers"]
            if not (
                split.get("type") == "Split"
                and "Regex" in split.get("pattern", {})
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
                and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("use_regex")
                and not byte_level.get("add_prefix_space")
            ):
                return None
            pattern = split["pattern"]["Regex"]
        else:
            return None
        return cls(backend.model, pattern, nfc=normalizer is not None)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        if len(self._cache) + len(self._runs) > _WORD_CACHE_LIMIT:
            self._cache.clear()
            self._runs.clear()
        runs, encode_run, encode_text = self._runs, self._encode_run, self._encode_by_regex
        results = []
        for text in texts:
            if self._nfc:
                text = unicodedata.normalize("NFC", text)
            chunks = text.split(" ")
            if not self._space_separable or chunks != text.split():
                results.append(encode_text(text))
                continue
            first = chunks[0]
            ids = list(runs.get(first) or encode_run(first))
            for chunk in chunks[1:]:
                run = " " + chunk
                ids += runs.get(run) or encode_run(run)
            results.append(ids)
        return results

    def _encode_run(self, run: str) -> list[int]:
        ids = self._runs[run] = self._encode_by_regex(run)
        return ids

    def _encode_by_regex(self, text: str) -> list[int]:
        cache, model, byte_chars = self._cache, self._model, self._byte_chars
        ids: list[int] = []
        for word in self._split(text):
            word_ids = cache.get(word)
            if word_ids is None:
                mapped = "".join(byte_chars[byte] for byte in word.encode("utf-8"))
                word_ids = cache[word] = [token.id for token in model.tokenize(mapped)]
            ids += word_ids
        return ids


class TmlCodec:
    """Wraps a ``tml_renderers.tokenizers`` tokenizer (e.g. DeepSeek V3.1's, which has no HF form here)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        special_ids = [tokenizer.encode_special(name) for name in tokenizer.special_tokens()]
        self._special_ids = {tokenizer.decode([token]): token for token in special_ids}
        ordered = sorted(self._special_ids, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(text) for text in ordered))
        self._bos_text = self._text_of_special(tokenizer.bos_token)
        self._eos_token_id = self._id_of_special(tokenizer.eos_token)

    def _text_of_special(self, name: str | None) -> str | None:
        token = self._id_of_special(name)
        return None if token is None else self.tokenizer.decode([token])

    def _id_of_special(self, name: str | None) -> int | None:
        if not name:
            return None
        return self.tokenizer.encode_special(name)

    def encode_template(self, text: str) -> list[int]:
        tokens: list[int] = []
        position = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > position:
                tokens += self.tokenizer.encode_ordinary(text[position : match.start()])
            tokens.append(self._special_ids[match.group()])
            position = match.end()
        if position < len(text):
            tokens += self.tokenizer.encode_ordinary(text[position:])
        return tokens

    def encode_content(self, text: str) -> list[int]:
        return list(self.tokenizer.encode_ordinary(text))

    def encode_content_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode_ordinary(text)) for text in texts]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    @property
    def bos_text(self) -> str | None:
        return self._bos_text

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id


_CODECS: dict[int, tuple[Any, TokenCodec]] = {}


def as_codec(tokenizer: Any) -> TokenCodec:
    """The codec for any supported tokenizer (HF fast, ``tokenizers.Tokenizer``, tml-renderers).

    Building one copies the tokenizer (seconds for a 150k vocabulary), so codecs are shared per
    tokenizer object: every renderer over the same tokenizer reuses one codec and its word cache.
    """
    if isinstance(tokenizer, (HuggingFaceCodec, TmlCodec)):
        return tokenizer
    cached = _CODECS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    if hasattr(tokenizer, "encode_ordinary") and hasattr(tokenizer, "encode_special"):
        codec: TokenCodec = TmlCodec(tokenizer)
    else:
        codec = HuggingFaceCodec(tokenizer)
    if len(_CODECS) >= 16:
        _CODECS.clear()
    _CODECS[id(tokenizer)] = (tokenizer, codec)
    return codec
