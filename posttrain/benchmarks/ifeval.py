"""IFEval: Google's verifiable instruction checks (from the PyPI package ``if-verifiable``), scored as inspect does.

inspect_evals' own IFEval task needs ``instruction_following_eval``, which is not on PyPI; the checks
here are the same Google code as packaged by ``if-verifiable``. Each sample's score holds the four
levels inspect_evals reports (prompt/instruction × strict/loose) and is aggregated by inspect_evals'
own ``if_metric``; the headline is ``prompt_level_strict``.

Two checks need NLTK's ``punkt`` sentence model, which NLTK downloads at run time. Offline, where it
is absent, sentences are split by the regex splitter shipped in the same IFEval code
(``split_into_sentences``) and words by NLTK's Treebank tokenizer (what ``word_tokenize`` applies per
sentence), so no check crashes; the log says so once.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from inspect_ai.dataset import Sample
from inspect_ai.scorer import Score, Scorer, Target, scorer
from inspect_ai.solver import TaskState

logger = logging.getLogger(__name__)


def record_to_sample(record: dict[str, Any]) -> Sample:
    """A ``google/IFEval`` record (key, prompt, instruction_id_list, kwargs) as an inspect sample."""
    kwargs = [{name: value for name, value in (entry or {}).items() if value is not None} for entry in record["kwargs"]]
    return Sample(
        id=record["key"],
        input=record["prompt"],
        metadata={"prompt": record["prompt"], "instruction_id_list": list(record["instruction_id_list"]), "kwargs": kwargs},
    )


def _metric() -> Any:
    from inspect_evals.ifeval.ifeval import if_metric

    return if_metric()


@scorer(metrics=[_metric()])
def instruction_following() -> Scorer:
    """Strict and loose, per prompt and per instruction, for each response."""
    checks = _instruction_checks()
    from if_verifiable.common import evaluate_instructions

    async def score(state: TaskState, target: Target) -> Score:
        instructions = state.metadata["instruction_id_list"]
        results, _ = evaluate_instructions(
            response=state.output.completion,
            instruction_id_list=instructions,
            kwargs_list=state.metadata["kwargs"],
            prompt=state.metadata["prompt"],
            instruction_registry=checks,
        )
        strict = sum(result.strict_pass for result in results)
        loose = sum(result.loose_pass for result in results)
        return Score(
            value={
                "prompt_level_strict": strict == len(instructions),
                "inst_level_strict": strict,
                "prompt_level_loose": loose == len(instructions),
                "inst_level_loose": loose,
                "num_instructions": len(instructions),
            },
            answer=state.output.completion,
            explanation=" ".join(f"{r.instruction_id}:{'pass' if r.strict_pass else 'fail'}" for r in results),
        )

    return score


@lru_cache(maxsize=1)
def _instruction_checks() -> dict[str, Any]:
    from if_verifiable.ifeval import instructions_util
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    import nltk

    try:
        nltk.data.find("tokenizers/punkt")
    except LookupError:
        logger.warning("NLTK punkt data not found: IFEval counts sentences with its regex splitter (offline fallback)")
        instructions_util._get_sentence_tokenizer = lambda: _RegexSentences()
        instructions_util.nltk = _OfflineNltk()
    return dict(INSTRUCTION_DICT)


class _RegexSentences:
    def tokenize(self, text: str) -> list[str]:
        from if_verifiable.ifeval.instructions_util import split_into_sentences

        return split_into_sentences(text)


class _OfflineNltk:
    """``nltk`` as IFEval's checks use it, with ``word_tokenize`` that needs no downloaded data."""

    def __getattr__(self, name: str) -> Any:
        import nltk

        return getattr(nltk, name)

    @staticmethod
    def word_tokenize(text: str) -> list[str]:
        from nltk.tokenize import TreebankWordTokenizer

        tokenizer = TreebankWordTokenizer()
        return [word for sentence in _RegexSentences().tokenize(text) for word in tokenizer.tokenize(sentence)]
