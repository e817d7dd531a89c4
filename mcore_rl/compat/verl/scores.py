"""verl's rule scorers for its math data sources, scoring the same strings to the same values (the table of strings per
source in tests/test_verl_rewards.py holds verl's edge cases).

    openai/gsm8k                          gsm8k_score      "#### <number>" in the last 300 characters, compared as
                                                           text with the ground truth ("#### 72.0" vs "72" scores 0)
    lighteval/MATH, DigitalLearningGmbH/  hendrycks_math_score   the last \\boxed answer (the whole response), MATH's
    MATH-lighteval, HuggingFaceH4/MATH-500                       own normalisation (Hendrycks et al. 2021), 1.0 or 0.0
    math_dapo, math, math_dapo_reasoning, dapo_score       "Answer: ..." in the last 300 characters, Minerva's
    aime*                                                  normalisation (Lewkowycz et al. 2022): score 1.0 or -1.0,
                                                           acc, pred

These follow the published procedures that verl's scorers implement; the differences from our lenient rules in
rule.py (numeric equality, a 1000-character tail) are why these exist: a verl user's reward curve means the same here.
"""

from __future__ import annotations

import re
from typing import Any

GSM8K_TAIL = 300  # verl scores only the last 300 characters of a GSM8K response
DAPO_TAIL = 300  # ... and of a DAPO math response


# --- GSM8K ----------------------------------------------------------------------------------------------------------


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K scorer reads: after the last "#### " (strict), else the last number (flexible)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-GSM8K_TAIL:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = re.findall(r"(\-?[0-9\.\,]+)", tail)
    if not numbers:
        return None
    valid = [n for n in numbers if n not in ("", ".")]
    return valid[-1] if valid else numbers[0]  # all invalid: verl's loop ends on the first one


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the answer equals the ground truth as text, `format_score` when it differs, 0 without one."""
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


# --- MATH (Hendrycks) -----------------------------------------------------------------------------------------------


class _Unnormalisable(Exception):
    """A string MATH's normalisation cannot parse: the two strings are then compared as they are."""


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` (braces matched) or `\\boxed x` (up to a `$`), else the last `\\fbox{...}`."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def _unbox(boxed: str) -> str | None:
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None  # \fbox{...}: verl's scorer fails on it and scores 0


def _braced_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    for part in rest:
        if not part:
            raise _Unnormalisable(s)
        head += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return head


def _braced_frac(s: str) -> str:
    head, *rest = s.split("\\frac")
    for part in rest:
        if not part:
            raise _Unnormalisable(s)
        head += "\\frac"
        if part[0] == "{":
            head += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            head += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            head += "{" + part[0] + "}" + part[1:]
    return head


def _slash_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalise_math(s: str) -> str:
    """MATH's answer normalisation (Hendrycks et al. 2021, the dataset's own `is_equiv`)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):  # fmt: skip
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise _Unnormalisable(s)
        s = parts[0]
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs = s.split("=")
    if len(lhs) == 2 and len(lhs[0]) <= 2:  # "k = 3" -> "3"
        s = lhs[1]
    s = _braced_frac(_braced_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_frac(s)


def math_equivalent(answer: str, truth: str) -> bool:
    """Equal after MATH's normalisation; compared as they are when it cannot parse them."""
    try:
        return normalise_math(answer) == normalise_math(truth)
    except (_Unnormalisable, IndexError):
        return answer == truth


def hendrycks_math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 when the last boxed answer equals the ground truth after MATH's normalisation, else 0.0."""
    boxed = last_boxed(solution_str)
    answer = _unbox(boxed) if boxed is not None else None
    return 1.0 if answer is not None and math_equivalent(answer, ground_truth) else 0.0


# --- DAPO / AIME (Minerva) ------------------------------------------------------------------------------------------

# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D.1), in its order.
_MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                          (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))  # fmt: skip
_MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip


def minerva_normalise(answer: str) -> str:
    """A final answer in Minerva's normal form."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _MINERVA_REMOVED:
        answer = answer.replace(word, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer).replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _dapo_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def dapo_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    strict_box_verify: bool = False,
) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": correct, "pred": the normalised answer}: the last "Answer: ..." line of the last
    300 characters against the ground truth, both in Minerva's normal form; strict_box_verify: the last boxed answer
    of the last 100 characters, equal to the ground truth as text."""
    tail = solution_str[-DAPO_TAIL:]
    if strict_box_verify:
        pred = _dapo_boxed(tail[-100:])
        correct = pred == ground_truth
    else:
        found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
        pred = minerva_normalise(found[-1] if found else "[INVALID]")
        correct = pred == minerva_normalise(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
