"""Built-in rule rewards, with verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info)`.

Each function scores one decoded response (`solution_str`, special tokens already stripped) against the dataset's
`reward_model.ground_truth` and returns a float or a dict holding at least "score" (other keys become metrics).

- `synthetic_digits_score`: the default CPU job's task (see `mcore_rl/data/synthetic.py`), with partial credit so
  that a randomly initialised policy gets a dense signal.
- `gsm8k_score`: GSM8K final answer after "#### " (strict) or the last number in the text (flexible).
- `math_boxed_score`: MATH-style answer in the last `\\boxed{...}`, compared after light string normalisation
  (no sympy: "1/2", "\\frac{1}{2}", "\\dfrac12" and "0.5" all compare equal; richer equivalence is out of scope).
"""

from __future__ import annotations

import math
import re
from typing import Any

# Regexes over very long responses are slow; the answer is at the end, so only the tail is searched (as verl does).
_TAIL_CHARS = 1000

# Weights of the synthetic reward (they sum to 1): digits where digits belong, the right digits, then stopping.
SYNTHETIC_FORMAT_WEIGHT = 0.1
SYNTHETIC_MATCH_WEIGHT = 0.7
SYNTHETIC_EXACT_WEIGHT = 0.2


def synthetic_digits_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Score a response to a synthetic digit task (`synthetic/copy_digit`, `synthetic/successor`, ...).

    With n = len(ground_truth) (a string of digits) and s = the response with trailing whitespace removed:

        score = 0.1 * (fraction of s[:n] that are digits)
              + 0.7 * (fraction of positions i < n with s[i] == ground_truth[i])
              + 0.2 * (s == ground_truth)         # the answer and nothing after it, i.e. the policy stopped

    Why partial credit: a random policy over the tiny 63-token vocabulary emits the right first digit with
    probability ~1/63 and the exact answer almost never, so a 0/1 reward would leave most GRPO groups without
    signal. The format term first pulls the policy towards digits (10/63 of random first tokens), the match term
    towards the right digit, and the exact term towards emitting eos right after it. A uniformly random policy
    scores about 0.03 on average; the correct answer scores 1.0.

    Returns a dict: "score", "acc" (1.0 for an exact answer) and "first_correct" (first digit right).
    """
    answer = solution_str.rstrip()
    n = len(ground_truth)
    if n == 0:
        raise ValueError(f"synthetic reward for data_source={data_source!r}: ground_truth is empty")
    head = answer[:n]
    format_frac = sum(ch.isdigit() for ch in head) / n
    match_frac = sum(a == b for a, b in zip(head, ground_truth)) / n
    exact = float(answer == ground_truth)
    score = SYNTHETIC_FORMAT_WEIGHT * format_frac + SYNTHETIC_MATCH_WEIGHT * match_frac + SYNTHETIC_EXACT_WEIGHT * exact
    first_correct = float(answer[:1] == ground_truth[:1])
    return {"score": score, "acc": exact, "first_correct": first_correct}


# --- the multi-turn lookup task ----------------------------------------------------------------------------------
# Weights (sum 1): the call's pieces, the right key, relaying what the tool answered, and the right answer.
LOOKUP_PIECE_WEIGHT = 0.05  # each of <tool_call>, the JSON head, a number as the key, }}, </tool_call>
LOOKUP_KEY_WEIGHT = 0.15
LOOKUP_RELAY_WEIGHT = 0.25  # the final answer starts with the value the call returned
LOOKUP_RELAY_EXACT_WEIGHT = 0.1  # ... and is exactly it
LOOKUP_ANSWER_WEIGHT = 0.25  # the final answer is the prompt's value (only the right key returns it)
_LOOKUP_CALL_HEAD = '{"name": "lookup", "arguments": {"key": '


def lookup_table(key: Any, value: Any, store: list[Any] | None) -> dict[str, str]:
    """One lookup row's table, as strings: its `store` (position -> value) when it has one, else key -> value. The
    reward here and the `lookup` tool (mcore_rl/rollout/agent/tools.py) read the same table."""
    if store is None:
        return {str(key): str(value)}
    return {str(i): str(v) for i, v in enumerate(store)}


def synthetic_lookup_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Score a `synthetic/lookup` episode (see `mcore_rl/data/synthetic.py`): the decoded response after the prompt,
    tool turns included (`<tool_call>...</tool_call>`, `<tool_response>...</tool_response>`, the final answer).

        score = 0.05 per piece of the expected call, each counted only right after the one before it (the call's
                     prefix): <tool_call>, the JSON head, a number, }}, </tool_call>
              + 0.15 if that number is the prompt's key
              + after a whole call: 0.25 if the final answer starts with the value the tool returned for the called
                key (the row's store), + 0.1 if it is exactly that value
              + 0.25 if the final answer is exactly the prompt's value (`ground_truth`) after a call with its key

    The final answer is the text after the last tool response. The prefix gives a random policy a gradient long
    before it completes a call, one piece at a time. Relaying the tool's value is learnt with any key (reading a
    tool response is the multi-turn skill); copying the prompt's key into the call then pays for the key and the
    right answer. Resting places under earlier weights, seen in decoded episodes: pieces credited out of order
    (`<tool_call>}}` scored as much as `<tool_call>` + head, and the policy never learnt the head); an answer that
    needed the right key first (never learnt: the key collapsed to one digit before the copy was found, the digits
    after the head riding on the head's advantage); a guess without a call that paid as much as the right call.
    Returns "score", "acc" (exact answer), "called" (the call was exactly right), "relayed" (the answer is exactly
    the tool's value).
    """
    create = (((extra_info or {}).get("tools_kwargs") or {}).get("lookup") or {}).get("create_kwargs") or {}
    key, store = create.get("key"), create.get("store")
    if key is None:
        raise ValueError(f"lookup reward for data_source={data_source!r}: extra_info.tools_kwargs.lookup has no key")
    store = lookup_table(key, ground_truth, store)
    first_turn = solution_str.split("<tool_response>", 1)[0]
    score, found, number = 0.0, 0, ""
    for piece in ("<tool_call>", _LOOKUP_CALL_HEAD, "KEY", "}}", "</tool_call>"):
        if piece == "KEY":
            number = re.match(r"\d*", first_turn).group()
            if not number:
                break
            score += LOOKUP_PIECE_WEIGHT + LOOKUP_KEY_WEIGHT * (number == str(key))
        elif first_turn.startswith(piece):
            score += LOOKUP_PIECE_WEIGHT
        else:
            break
        first_turn = first_turn[len(number if piece == "KEY" else piece) :]
        found += 1
    right_key = number == str(key)
    returned, answer = store.get(number) if found == 5 else None, None
    if returned is not None and "</tool_response>" in solution_str:
        answer = solution_str.rsplit("</tool_response>", 1)[-1].split("assistant\n", 1)[-1].strip()
        score += LOOKUP_RELAY_WEIGHT * (answer[: len(returned)] == returned)
        score += LOOKUP_RELAY_EXACT_WEIGHT * (answer == returned)
        score += LOOKUP_ANSWER_WEIGHT * (answer == ground_truth and right_key)
    return {
        "score": score,
        "acc": float(answer == ground_truth and right_key),
        "called": float(found == 5 and right_key),
        "relayed": float(answer is not None and answer == returned),
    }


# --- GSM8K -------------------------------------------------------------------------------------------------------

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"\-?[0-9\.\,]+")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """Extract the final answer: after the last "#### " (strict) or the last number anywhere (flexible).

    Returns the number with thousands separators removed, or None when there is none.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"extract_gsm8k_answer: method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
    else:
        # A lone "." or "," also matches the number pattern; skip those.
        found = [m for m in _NUMBER.findall(tail) if any(ch.isdigit() for ch in m)]
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    """True when two answer strings are equal as text or as numbers ("42", "42.0", "1,000" vs "1000")."""
    a, b = a.replace(",", "").strip(), b.replace(",", "").strip().lstrip("$")
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """GSM8K reward: `correct_score` if the extracted answer equals the ground truth, `format_score` if an answer
    was found but is wrong, 0 if none was found. `method` picks strict ("#### 42") or flexible (last number)."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return correct_score if _same_number(answer, ground_truth) else format_score


# --- MATH (\boxed{...}) ------------------------------------------------------------------------------------------


def extract_boxed(solution_str: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; `\\boxed 5` also accepted."""
    tail = solution_str[-_TAIL_CHARS:]
    boxed, fbox = tail.rfind("\\boxed"), tail.rfind("\\fbox")
    if boxed < 0 and fbox < 0:
        return None
    after = tail[boxed + len("\\boxed") :] if boxed > fbox else tail[fbox + len("\\fbox") :]
    if after.startswith(" "):
        # "\boxed 5": the answer is the next whitespace-free word.
        words = after.split()
        return words[0].rstrip("$.") if words else None
    if not after.startswith("{"):
        return None
    depth = 1
    for i, ch in enumerate(after[1:]):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return after[1 : i + 1]
    return None  # unbalanced braces: the response was cut off


_FRAC = re.compile(r"\\[dt]?frac\{?(-?\d+)\}?\{?(-?\d+)\}?")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^}]*)\}")


def normalize_math_answer(answer: str) -> str:
    """Light normalisation of a math answer string, so trivially different spellings compare equal.

    Removes spaces, `$`, `\\left`/`\\right`, `\\!`, degree marks, a trailing period and `\\text{}` wrappers; turns
    integer fractions (`\\frac{1}{2}`, `\\dfrac12`, `1/2`) and decimals into a canonical number when exact.
    """
    s = _TEXT.sub(r"\1", answer)
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", "^\\circ", "^{\\circ}", " "):
        s = s.replace(old, "")
    s = s.rstrip(".")
    s = _FRAC.sub(r"\1/\2", s)
    number = _as_number(s)
    return s if number is None else number


def _as_number(s: str) -> str | None:
    """Canonical text of an integer, decimal or integer fraction ("0.50" -> "0.5", "2/4" -> "0.5"); else None."""
    try:
        if "/" in s:
            num, den = s.split("/")
            value = int(num) / int(den)
        else:
            value = float(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    if not math.isfinite(value):  # "inf" and "nan" parse as floats but are not answers to compare numerically
        return None
    return str(int(value)) if value == int(value) else repr(round(value, 10))


def math_boxed_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """MATH reward: 1.0 if the last `\\boxed{}` answer equals the ground truth after normalisation, else 0.0.

    The ground truth may itself be wrapped in `\\boxed{}` (some datasets store it that way)."""
    answer = extract_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = extract_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    if truth is None:
        return 0.0
    return float(normalize_math_answer(answer) == normalize_math_answer(truth))
