"""Math final-answer correctness reward: extract a completion's final answer and compare it
with the gold answer (fast exact numeric check, then math-verify); 1.0 if equal else 0.0.

Answer extraction priority (within the last ``<answer>...</answer>`` block if there is one):
last ``\\boxed{...}`` (nested braces), then ``#### n`` (GSM8K), then "the answer is ...",
then the last number in the text. Gold answers may be bare or full GSM8K solutions ending in
``#### n``.

math-verify guards its own work with ``signal.alarm``, which raises outside the main thread;
it is therefore always called here with ``parsing_timeout=None`` / ``timeout_seconds=None`` and
time limits are enforced by ``posttrain.rewards.runner`` instead.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "math_answer",
    "extract_answer",
    "extract_gold",
    "to_number",
    "answers_match",
    "score_answer",
]

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"-?\\[dt]?frac\{{-?\d+\}}\{{\d+\}}|(?:{_NUMBER})(?:\s*/\s*(?:\d+(?:\.\d+)?))?")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:)\s*:?\s*(.+?)(?=\.\s|\.?\s*$|\n)",
    re.IGNORECASE | re.DOTALL,
)
_TEXT_CMD_RE = re.compile(r"\\(?:text|mbox|mathrm|textbf)\s*\{\s*([^{}]*)\}")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUM_WITH_UNIT_RE = re.compile(rf"^({_NUMBER})\s+[A-Za-z]{{2,}}(?:\s+[A-Za-z]+)*$")


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _clean(s: str) -> str:
    """Strip presentation noise: ``$``, ``\\$``, ``%``, latex spacing, unit ``\\text{}``, trailing period."""
    s = s.strip()
    s = _TEXT_CMD_RE.sub(lambda m: "" if re.fullmatch(r"[A-Za-z\s.]*", m.group(1)) else m.group(1), s)
    for tok in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "{,}", "\\left", "\\right", "\\displaystyle"):
        s = s.replace(tok, "" if tok != "{,}" else ",")
    s = s.strip()
    s = re.sub(r"^\\?\(|\\?\)$", "", s) if s.startswith("\\(") else s
    while s.endswith(".") or s.endswith(","):
        s = s[:-1].rstrip()
    return s.strip()


def to_number(s: Any) -> Fraction | None:
    """Parse a cleaned answer string as an exact number (``Fraction``), or None.

    Accepts ``-12``, ``1,234``, ``1234.00``, ``.5``, ``3/4``, ``\\frac{3}{4}``, ``$1,234.00.``,
    ``50%`` and ``18 dollars``-style trailing unit words.
    """
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        try:
            return Fraction(s)
        except (ValueError, OverflowError):
            return None
    s = _clean(str(s))
    if not s:
        return None
    m = _NUM_WITH_UNIT_RE.match(s)
    if m:
        s = m.group(1)
    m = _FRAC_RE.match(s)
    if m:
        sign, num, den = m.groups()
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign else value
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?", s):
        return None
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion as a string (see module docstring for the priority)."""
    if not isinstance(text, str) or not text:
        return None
    tags = _ANSWER_TAG_RE.findall(text)
    if tags:
        text = tags[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    hashes = _HASH_RE.findall(text)
    if hashes:
        ans = _clean(hashes[-1])
        if ans:
            return ans
    stated = _ANSWER_IS_RE.findall(text)
    if stated:
        ans = _clean(stated[-1])
        if ans and (to_number(ans) is not None or re.search(r"[\\^{}]", ans)):
            return ans
        nums = _NUMBER_RE.findall(ans)
        if nums:
            return _clean(nums[0])
        if ans:
            return ans
    matches = list(_NUMBER_RE.finditer(text))
    if matches:
        last = matches[-1]
        ans = last.group(0)
        if ans.startswith("-") and last.start() > 0 and (text[last.start() - 1].isalnum() or text[last.start() - 1] in ")}"):
            ans = ans[1:]  # "3-5" or "x-5": a binary minus, not a negative number
        return _clean(ans)
    return None


def extract_gold(answer: Any) -> str:
    """Gold answer string: the text after the last ``####`` of a GSM8K solution, the last
    ``\\boxed{}`` of a worked solution, or the answer itself."""
    s = str(answer)
    if "####" in s:
        return _clean(s.rsplit("####", 1)[1])
    boxed = _last_boxed(s)
    if boxed is not None:
        return _clean(boxed)
    return _clean(s)


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; that is deliberate here (see docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_FILTER_INSTALLED = False


def _math_verify_equal(pred: str, gold: str) -> bool:
    global _FILTER_INSTALLED
    from math_verify import parse, verify  # lazy: keeps worker start-up light

    if not _FILTER_INSTALLED:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _FILTER_INSTALLED = True

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def answers_match(pred: str | None, gold: str) -> bool:
    """True when the extracted prediction equals the gold answer.

    If both sides parse as plain numbers they are compared exactly (``Fraction``) and the
    result is final; otherwise math-verify decides (symbolic / latex equivalence).
    """
    if pred is None or gold is None:
        return False
    p, g = to_number(pred), to_number(gold)
    if p is not None and g is not None:
        return p == g
    if not pred.strip() or not str(gold).strip():
        return False
    if pred.strip() == str(gold).strip():
        return True
    try:
        return _math_verify_equal(pred, gold)
    except Exception:  # math-verify is robust by default; never let a parse crash a batch
        return False


def score_answer(completion: str, gold_answer: Any) -> float:
    """1.0 if the completion's final answer matches ``gold_answer`` (bare or GSM8K ``#### n``)."""
    return 1.0 if answers_match(extract_answer(completion), extract_gold(gold_answer)) else 0.0


def math_answer(prompts: list[str], completions: list[str], answer: list[Any], **fields) -> list[float]:
    """Reward: 1.0 per completion whose final answer matches the aligned gold ``answer``, else 0.0."""
    if len(answer) != len(completions):
        raise ValueError(f"math_answer: {len(answer)} answers for {len(completions)} completions")
    return [score_answer(c, a) for c, a in zip(completions, answer)]


math_answer.required_fields = ("answer",)
