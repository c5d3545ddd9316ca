"""Grading math answers with ``math-verify``: one grader for GSM8K-format and MATH answers.

The model is asked (inspect's convention) to end with ``ANSWER: <answer>``. When such a line exists
only it is graded (as LaTeX when it looks like math, else as text, so ``18 dollars`` reads 18), so a
number in the reasoning cannot count; otherwise math-verify extracts the
final expression itself (the last ``\\boxed{}``, then the last LaTeX or plain expression).
math-verify then compares *values*: ``1,000`` = ``1000``, ``\\frac{1}{2}`` = ``0.5``, ``x=3`` = ``3``,
equal sets and intervals — which a regex over numbers cannot. A word is no math (math-verify would read
``Paris`` as the product of five symbols, equal to ``sirap``): a gold answer that is a word or phrase
compares as text, case and final punctuation aside.

:func:`same_value` compares an answer already extracted from a response (``posttrain.eval.answers``) with
the gold answer the same way: the RL environments, eval reports and distillation agreement use it.

math-verify bounds its sympy work with ``signal.alarm``, which only the main thread may use: off the
main thread (a Dagster step thread, a worker) the bound is left off rather than crashing.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

_ANSWER_LINE = re.compile(r"ANSWER\s*:\s*(.+)", re.IGNORECASE)
_LATEX_HINT = re.compile(r"[\\{}()\[\]^]")  # LaTeX, tuples, intervals: read as math; "18 dollars" as text
_PLAIN_NUMBER = re.compile(r"[-+]?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\$?\d+(?:\.\d+)?\.?")  # 1,234.5  $72  72.
_WORDS = re.compile(r"[A-Za-z]{2,}(?:[\s'-]+[A-Za-z]+)*")  # a text answer ("Paris", "New York"): not math
TIMEOUT_S = 5


@dataclass(frozen=True)
class MathGrade:
    correct: bool
    extracted: str  # what was graded (the ANSWER line, or math-verify's pick), for the sample's record


def answer_line(response: str) -> str | None:
    """The text after the last ``ANSWER:`` (to the end of its line), or None."""
    matches = _ANSWER_LINE.findall(response)
    if not matches:
        return None
    return matches[-1].strip().strip("$").strip() or None


def grade_math(response: str, gold: str) -> MathGrade:
    """Is ``response``'s final answer mathematically equal to ``gold`` (a number or LaTeX)?"""
    from math_verify import parse, verify

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else 0
    stated = answer_line(response)
    if is_text_answer(gold):
        said = stated if stated is not None else (response.strip().splitlines() or [""])[-1]
        return MathGrade(_normalized_text(said) == _normalized_text(gold), said)
    if stated is None:
        predicted = parse(response, parsing_timeout=timeout)
    else:
        readings = [_as_latex(stated), stated] if _LATEX_HINT.search(stated) else [stated, _as_latex(stated)]
        predicted = next((found for found in (parse(text, parsing_timeout=timeout) for text in readings) if found), [])
    expected = parse(_as_latex(gold), parsing_timeout=timeout)
    if not predicted or not expected:
        return MathGrade(False, str(predicted[-1]) if predicted else "")
    correct = bool(verify(expected, predicted, timeout_seconds=timeout or None))
    return MathGrade(correct, str(predicted[-1]))


def same_value(predicted: str | None, gold: str) -> bool:
    """Does the extracted answer ``predicted`` state ``gold``? (``1234.0`` = ``1,234``, ``3/4`` = ``0.75``;
    words compare as text.) None — no answer was found — never does."""
    if predicted is None or not predicted.strip():
        return False
    numbers = _plain_number(predicted), _plain_number(gold)
    if None not in numbers:  # the common case (GSM8K, arithmetic): no sympy, so no unbounded work off the main thread
        return math.isclose(numbers[0], numbers[1], rel_tol=1e-9, abs_tol=1e-9)
    return grade_math(f"ANSWER: {predicted.strip()}", gold).correct


def _plain_number(text: str) -> float | None:
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", "").replace("$", "").rstrip("."))


def is_text_answer(answer: str) -> bool:
    return _WORDS.fullmatch(answer.strip().rstrip(".!")) is not None


def _normalized_text(text: str) -> str:
    return " ".join(text.strip().strip(".!").lower().split())


def _as_latex(answer: str) -> str:
    """A bare answer in math delimiters, so math-verify's LaTeX extraction reads all of it."""
    answer = answer.strip()
    if "\\boxed" in answer or answer.startswith("$"):
        return answer
    return f"${answer}$"
