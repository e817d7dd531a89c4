"""Built-in rule rewards, with verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info)`.

Each function scores one decoded response (`solution_str`, special tokens already stripped) against the dataset's
`reward_model.ground_truth` and returns a float or a dict holding at least "score" (other keys become metrics).

- `synthetic_digits_score`: the default CPU job's task (see `mcore_rl/data/synthetic.py`), with partial credit so
  that a randomly initialised policy gets a dense signal.
- `synthetic_lookup_score`: the multi-turn tool job's task, credited piece by piece.
- `arithmetic_score`: the real-model recipe's addition questions (`mcore_rl/data/arithmetic.py`), 0 or 1.

verl's data sources (GSM8K, MATH, DAPO, AIME) are scored by `compat/verl/scores.py`, as verl scores them.
"""

from __future__ import annotations

import re
from typing import Any

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


_INTEGER = re.compile(r"-?\d+")


def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Score an answer to an `arith/add` question ("What is 7 + 5? Answer with just the number."): 1.0 when the
    last integer in the response is the sum, else 0.0 (verl's GSM8K "flexible" rule: the last number is the answer).

    The last number, not the whole response: the untrained model often writes "7 + 5 = 12", which is right; a
    response that stops at the number is preferred by GRPO anyway, since longer ones more often end on another number.
    Metrics: "acc" (the same 0/1) and "bare" (the response is the number alone).
    """
    if not ground_truth or not _INTEGER.fullmatch(ground_truth.strip()):
        raise ValueError(
            f"arithmetic reward for data_source={data_source!r}: ground_truth {ground_truth!r} is not an integer"
        )
    numbers = _INTEGER.findall(solution_str)
    right = float(bool(numbers) and int(numbers[-1]) == int(ground_truth))
    return {"score": right, "acc": right, "bare": float(solution_str.strip().rstrip(".") == ground_truth.strip())}
