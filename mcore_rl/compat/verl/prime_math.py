"""verl's scorer for its `numina_*` data sources (verl sends them to `prime_math`): the same score on the same strings.

    response -> match_answer (last "answer:"/"answer is"/boxed/"is"/"=" marker) -> the candidate answer
    candidate, ground truth -> grade_answer: equal after MATH's normalisation (Hendrycks), or after PRM800K's
                               normalisation, element-wise for tuples/intervals, or sympy finds the difference 0
                            -> else math_equal: numbers within 1e-4 (also x100 and /100, for percentages),
                               intervals and tuples element-wise, sympy's simplify/N of the difference
    score: 1.0 when either grader accepts, else 0.0 (verl's default_compute_score keeps the first of its tuple)

Three deliberate differences from verl's code, none of which changes a score in the table of strings in
tests/test_verl_math.py (where verl's own grader was run on each string):
  * LaTeX is turned into plain text by `latex_to_text` (a small subset of pylatexenc's rules that verl uses:
    \\frac, \\sqrt, \\pi, \\times, \\cdot, \\text, groups); pylatexenc is not a dependency here.
  * sympy's `parse_latex` (needs antlr4 4.11, absent here and in most verl installs) is not tried.
  * `parse_expr` evaluates Python: it is only given strings of arithmetic characters (no `_`, quotes, brackets,
    `:` or `=`), so a response cannot run code in the trainer. verl passes any string.
Each sympy call is bounded (SYMPY_TIMEOUT_S, verl's 10 s), see `_bounded`.
"""

from __future__ import annotations

import ast
import math
import multiprocessing
import operator
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

from mcore_rl.compat.verl import scores

SYMPY_TIMEOUT_S = 10.0  # verl's limit on one sympy parse/simplify
NUMINA_DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                       "numina_cn_k12", "numina_olympiads")  # fmt: skip  # verl's list, exact names


class _Timeout(Exception):
    pass


def _bounded(fn: Callable[..., Any], *args: Any, seconds: float = SYMPY_TIMEOUT_S) -> Any:
    """fn(*args), raising _Timeout after `seconds`. On the main thread a SIGALRM interrupts it; on another thread
    (the reward manager's pool) it runs in a forked child that is killed at the limit, as verl does, so a runaway
    simplify does not keep a core busy after the manager's own per-call timeout gave up on it."""
    if threading.current_thread() is threading.main_thread():

        def on_alarm(*_: Any) -> None:
            raise _Timeout()

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=_child, args=(queue, fn, args), daemon=True)
    child.start()
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join()
        raise _Timeout()
    ok, value = queue.get() if not queue.empty() else (False, None)
    if not ok:
        raise ValueError("sympy failed")
    return value


def _child(queue: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        queue.put((True, fn(*args)))
    except Exception:
        queue.put((False, None))


# --- the candidate answer -------------------------------------------------------------------------------------------


def _last_boxed_content(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, left = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            left = i if left is None else left
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1 : i].strip() if left is not None else None
    return None


def _after(response: str, marker: str) -> tuple[bool, str]:
    at = response.lower().rfind(marker)
    if at < 0:
        return False, response
    response = response[at + len(marker) :].strip()
    return True, response[:-2] if response.endswith("\n") else response


def match_answer(response: str) -> tuple[bool, str]:
    """(found, answer): verl's prime_math extraction, markers in its order; found needs a digit in the answer."""
    matched = False
    for marker in ("answer:", "answer is", "answers are"):
        found, response = _after(response, marker)
        matched |= found
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        at = response.lower().rfind(marker)
        if at >= 0:
            matched, response = True, response[:at].strip()
            response = response[:-2] if response.endswith("\n") else response
    boxed = _last_boxed_content(response)
    if boxed:
        matched, response = True, boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        found, response = _after(response, marker)
        matched |= found
    return matched and any(c.isdigit() for c in response), response


# --- normalisation --------------------------------------------------------------------------------------------------


def mathd_normalise(answer: str) -> str:
    """MATH's normalisation (scores.normalise_math) after stripping a whole-answer \\text{}; unchanged when it
    cannot parse the answer."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return scores.normalise_math(answer)
    except Exception:  # verl's normalize_answer: any failure leaves the answer as it is
        return answer


_SYMBOLS = {"pi": "pi", "infty": "inf", "cup": "U", "cdot": "*", "times": "*", "div": "/", "le": "<=", "ge": ">=",
            "leq": "<=", "geq": ">=", "%": "%", "$": "$", "{": "{", "}": "}", "circ": "\N{DEGREE SIGN}"}  # fmt: skip
_TEXT_MACROS = ("text", "textbf", "mathrm", "mathbf", "mbox", "operatorname", "textit", "boxed")


def latex_to_text(expr: str) -> str:
    """LaTeX as plain text, following the rules of pylatexenc's latex2text that matter for answers: \\frac{a}{b}
    -> a/b (no parentheses, as pylatexenc), \\sqrt{x} -> sqrt(x), symbols by name, text macros and groups by their
    content, other macros dropped; a macro without arguments swallows the spaces after it."""
    group = r"\{([^{}]*)\}"
    for _ in range(len(expr)):
        previous = expr
        expr = re.sub(r"\\frac\s*" + group + r"\s*" + group, r"\1/\2", expr)
        expr = re.sub(r"\\sqrt\s*(?:\[[^\]]*\])?\s*" + group, r"sqrt(\1)", expr)
        expr = re.sub(r"\\(?:" + "|".join(_TEXT_MACROS) + r")\s*" + group, r"\1", expr)
        if expr == previous:
            break
    expr = re.sub(r"\\sqrt\s*(\w)", r"sqrt(\1)", expr)
    expr = re.sub(r"\\(left|right)\b\s*", "", expr)
    expr = re.sub(r"\\([a-zA-Z]+)\s*", lambda m: _SYMBOLS.get(m.group(1), ""), expr)
    expr = re.sub(r"\\([%${}])", lambda m: "\0" + m.group(1), expr)  # escaped braces survive the group removal
    expr = re.sub(r"\\[,;! ]", " ", expr).replace("{", "").replace("}", "").replace("\0", "")
    return expr.replace("\N{DEGREE SIGN}", "")


_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard", "liter")  # fmt: skip


def _strip_commas(expr: str) -> str:
    """Thousands separators ("1,000") removed; tuple commas kept."""
    while True:
        new = re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
        if new == expr:
            return new
        expr = new


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _str_is_int(s: str) -> bool:
    x = _float(_strip_commas(s))
    return x is not None and math.isfinite(x) and abs(x - int(round(x))) <= 1e-7


def prm800k_normalise(expr: str) -> str:
    """PRM800K's answer normalisation (Lightman et al. 2023) as verl's prime_math applies it."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    x = _float(expr)
    if x is not None and math.isfinite(x) and abs(x - int(round(x))) <= 1e-7:
        expr = str(int(round(x)))
    if "\\" in expr:
        expr = latex_to_text(
            expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
        )
        expr = expr.strip()
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number "7 1/2" is 7+1/2
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


# --- sympy, bounded and on arithmetic only --------------------------------------------------------------------------

_SAFE = re.compile(r"^[0-9A-Za-z\s+\-*/^().,<>!%]*$")  # what parse_expr may see: no _, quotes, brackets, :, =


def _sympy_difference_is_zero(a: str, b: str, implicit: bool) -> bool:
    """sympy.simplify((a) - (b)) == 0, parsed with PRM800K's transformations (implicit) or parse_expr's defaults."""
    import sympy
    from sympy.parsing import sympy_parser

    transformations: Any = sympy_parser.standard_transformations
    if implicit:
        transformations += (sympy_parser.implicit_multiplication_application,)
        return bool(sympy.simplify(sympy_parser.parse_expr(f"({a})-({b})".replace("^", "**"),
                                                            transformations=transformations)) == 0)  # fmt: skip
    x, y = sympy_parser.parse_expr(a), sympy_parser.parse_expr(b)
    try:  # verl tries simplify, then the numbers, each on its own
        if sympy.simplify(x - y) == 0:
            return True
    except Exception:
        pass
    return math.isclose(float(sympy.N(x)), float(sympy.N(y)), rel_tol=1e-4)


def sympy_equal(a: str, b: str, implicit: bool) -> bool:
    """Whether sympy finds a == b; False when either is not plain arithmetic, fails to parse, or takes too long."""
    if not (_SAFE.match(a) and _SAFE.match(b)) or "__" in a + b:
        return False
    import sympy.parsing.sympy_parser  # noqa: F401  imported here, so a forked child does not import it per call

    try:
        return bool(_bounded(_sympy_difference_is_zero, a, b, implicit))
    except Exception:  # parse errors, TypeError on non-numbers, _Timeout: verl scores them as not equal
        return False


# --- PRM800K's grade_answer -----------------------------------------------------------------------------------------


def _allow_eval(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^", expr) is None and re.search(r"\^[0-9][0-9]+", expr) is None


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]" and not any(c in expr[1:-1] for c in "()[]"):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def grade_answer(given: str, truth: str) -> bool:
    """PRM800K's grader: equal after either normalisation, else element-wise with sympy (unreduced fractions and
    integers must match exactly)."""
    if mathd_normalise(truth) == mathd_normalise(given):
        return True
    truth_n, given_n = prm800k_normalise(truth), prm800k_normalise(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = _split_tuple(truth_n), _split_tuple(given_n)
    if len(truth_elems) != len(given_elems):
        return False
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # "(1,3)" is not "[1,3)"
    for t, g in zip(truth_elems, given_elems, strict=True):
        if _is_frac(t) and _is_frac(g):
            ok = t == g
        elif _str_is_int(t) != _str_is_int(g):
            ok = False
        else:
            ok = _allow_eval(f"({t})-({g})") and sympy_equal(t, g, implicit=True)
        if not ok:
            return False
    return True


# --- ToRA's math_equal ----------------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def _arithmetic(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.operand))
    raise ValueError("not arithmetic")


def _with_pi(s: str, pi: float) -> Any:
    """\\pi replaced by the number (after a digit: times it) and the result evaluated when it is arithmetic."""
    while "\\pi" in s:
        at = s.find("\\pi")
        s = s[:at] + (f"*{pi}" if at > 0 and s[at - 1].isdigit() else f"1*{pi}") + s[at + 3 :]
    try:
        return _arithmetic(ast.parse(s, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError):
        return s


def _pre(answer: str, pi: float) -> Any:
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:  # "10_{2}": a number in a base, compared by its digits (as verl)
        return int(float(answer.split("_")[0]))
    return _with_pi(answer, pi) if "\\pi" in answer else answer


def _number(x: Any) -> float | None:
    s = str(x)
    return _float(s.replace("{,}", "") if "{,}" in s else s.replace(",", ""))


def math_equal(prediction: Any, reference: Any, pi: float = math.pi) -> bool:
    """ToRA's math_equal as verl's prime_math runs it: text, numbers (with x100 and /100), intervals and tuples
    element-wise, then sympy."""
    prediction = _pre(prediction, pi) if isinstance(prediction, str) else prediction
    reference = _pre(reference, pi) if isinstance(reference, str) else reference
    if isinstance(prediction, str):
        prediction = prediction[:1000]
        if isinstance(reference, str) and (prediction.strip().lower() == reference.strip().lower()
                                           or prediction.replace(" ", "") == reference.replace(" ", "")):  # fmt: skip
            return True
    p, r = _number(prediction), _number(reference)
    if p is not None and r is not None:
        return any(math.isclose(c, p, rel_tol=1e-4) for c in (r / 100, r, r * 100))
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    pred_s, ref_s = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for c in "{}()":
        pred_s, ref_s = pred_s.replace(c, ""), ref_s.replace(c, "")
    if pred_s == ref_s:
        return True
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):  # fmt: skip
        ps, rs = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(ps) == len(rs) and all(math_equal(a, b) for a, b in zip(ps, rs, strict=True)):
            return True
    if "," in prediction and "," in reference:
        ps, rs = [x.strip() for x in prediction.split(",")], [x.strip() for x in reference.split(",")]
        if len(ps) == len(rs):
            return all(math_equal(a, b) for a, b in zip(ps, rs, strict=True))
    return sympy_equal(prediction, reference, implicit=False)


def prime_math_result(solution_str: str, ground_truth: str) -> tuple[bool, bool, str]:
    """(correct, format correct, extracted answer): what verl's prime_math.compute_score returns."""
    solution_str, ground_truth = str(solution_str), str(ground_truth)
    _, answer = match_answer(solution_str)
    well_formed = "Step 2:" in solution_str and "\\box" in solution_str
    if grade_answer(answer, ground_truth):
        return True, True, answer
    pis = (math.pi, 3.14) if "\\pi" in answer or "\\pi" in ground_truth else (math.pi,)
    try:
        correct = any(math_equal(answer, ground_truth, pi=pi) for pi in pis)
    except Exception:  # verl: any failure of the fallback grader is a wrong answer
        correct = False
    return correct, well_formed, answer


def numina_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """verl's score for numina_* sources: 1.0 when the extracted answer grades equal to the ground truth, else 0.0."""
    return 1.0 if prime_math_result(solution_str, ground_truth)[0] else 0.0
