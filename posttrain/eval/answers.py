"""Pulling a final answer out of a model's response, as the string a problem's scorer grades.

Order of preference, so an explicit answer beats an incidental number: the last ``\\boxed{...}``
(balanced braces), then text after the last ``####`` (GSM8K), then after the last "answer is" /
"Answer:", and finally the last number anywhere. Comparing it with a gold answer is math-verify's job
(``posttrain.eval.math_answers.same_value``); a scorer that takes the answer as a string (reasoning-gym's
own, the guess-the-number env's) gets exactly this text.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with nested braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip()
            depth -= 1
    return None


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return _clean_number(matches[-1]) if matches else None


def extract_answer(text: str) -> str | None:
    """The response's final answer as a string, or None when it gives none."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return last_number(tail.splitlines()[0]) or tail.splitlines()[0].strip()
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        stated = (matches[-1].group(1).strip().splitlines() or [""])[0].strip()  # "answer is " + spaces: none
        number = _NUMBER.match(stated.lstrip("$ "))
        if number:
            return _clean_number(number.group(0))
        return stated.rstrip(".").strip() or None
    return last_number(text)


def to_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _clean_number(raw: str) -> str:
    return raw.replace(",", "").replace("$", "").rstrip(".")
