"""verl's numina_* scorer (prime_math) reproduced: each (response, ground truth) below scores what verl's own
prime_math.compute_score returns on it (run outside this repo on verl b178a3c's prime_math/{__init__,grader,
math_normalize}.py with pylatexenc 2.11 and this venv's sympy 1.14; sympy's parse_latex could not load there, as here),
plus the bounds this port adds: a response cannot make sympy evaluate code, and a slow sympy call is cut off."""

from __future__ import annotations

import threading
import time

import pytest

from mcore_rl.compat.verl import prime_math
from mcore_rl.reward.loader import builtin_reward, default_compute_score

#: (response, ground truth, verl's score)
CASES = [
    ("The answer is \\boxed{72}.", "72", 1.0),
    ("So we get \\boxed{72.0}", "72", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{5 cm}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{[1, 3)}", "[1,3)", 1.0),
    ("\\boxed{(1, 3)}", "[1,3)", 0.0),
    ("\\boxed{1.5\\times 10^{3}}", "1500", 0.0),
    ("\\boxed{1.5e3}", "1500", 1.0),
    ("the final answer is 42", "42", 1.0),
    ("Answer: 42", "42", 1.0),
    ("42", "42", 1.0),
    ("We have x = 7. So", "7", 1.0),
    ("\\boxed{x = 7}", "7", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{73}", "72", 0.0),
    ("no answer here", "72", 0.0),
    ("\\boxed{3 and 5}", "3, 5", 0.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{1.5708}", "\\frac{\\pi}{2}", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\text{B}}", "B", 1.0),
    ("\\boxed{10_{2}}", "10", 1.0),
    ("\\boxed{2 million}", "2000000", 0.0),
    ("\\boxed{7\\frac{1}{2}}", "7.5", 1.0),
    ("\\boxed{-3}", "- 3", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{\\frac{a+b}{c}}", "(a+b)/c", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{\\left(1, \\frac{1}{2}\\right)}", "(1, 1/2)", 1.0),
    ("\\boxed{2\\pi}", "6.28", 1.0),
    ("\\boxed{6.2832}", "2\\pi", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{x \\in [2, 5]}", "[2,5]", 0.0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty, 3)", 1.0),
    ("\\boxed{\\frac{3}{6}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{3 \\cdot 4}", "12", 0.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    ("\\boxed{A}", "A", 1.0),
    ("\\boxed{\\mathrm{B}}", "B", 1.0),
    ("The answer is 5 apples.", "5", 0.0),
    ("Thus, the result is \\boxed{\\dfrac{7}{2}} meters.", "3.5", 1.0),
    ("\\boxed{12\\%}", "12", 1.0),
    ("\\boxed{0.12}", "12\\%", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{1e-3}", "0.001", 1.0),
    ("\\boxed{10^{-3}}", "0.001", 0.0),
    ("\\boxed{2^{10}}", "1024", 0.0),
    ("\\boxed{x=2 \\text{ or } x=3}", "2, 3", 0.0),
    ("\\boxed{2, 3}", "2,3", 1.0),
    ("\\boxed{3, 2}", "2,3", 0.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", 1.0),
    ("\\boxed{1\\,000\\,000}", "1000000", 0.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("Step 2: so \\boxed{4}", "4", 1.0),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{y = 2x + 1}", "2x+1", 1.0),
    ("\\boxed{\\sqrt[3]{2}}", "2^{1/3}", 0.0),
    ("\\fbox{9}", "9", 1.0),
    ("answer: \\boxed{__import__('os')}", "1", 0.0),
    ("\\boxed{3.14}", "\\pi", 1.0),
    ("\\boxed{45^{\\circ}}", "45", 1.0),
    ("\\boxed{\\$1,250.50}", "1250.5", 1.0),
    ("\\boxed{7 \\frac{1}{2}}", "\\frac{15}{2}", 1.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), CASES)
def test_numina_scores_as_verl(response: str, truth: str, expected: float) -> None:
    assert default_compute_score("numina_olympiads", response, truth) == expected


def test_all_of_verls_numina_sources_are_registered_and_no_others() -> None:
    for source in prime_math.NUMINA_DATA_SOURCES:
        assert builtin_reward(source) is prime_math.numina_score
    assert builtin_reward("numina_unknown") is None  # verl raises NotImplementedError for it too


def test_a_response_cannot_make_sympy_run_code() -> None:
    import os
    import shutil
    import tempfile

    # sympy's parse_expr evaluates Python, builtins included; verl hands it the answer as it is. No "_" in the path:
    # verl's base handling ("10_{2}") would stop the answer before it reaches sympy.
    directory = os.path.join(tempfile.gettempdir(), f"numina{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, "ran")
    try:
        payload = f"\\boxed{{open('{marker}','w')}}"
        assert prime_math.numina_score("numina_olympiads", payload, "1") == 0.0
        assert not os.path.exists(marker)
    finally:
        shutil.rmtree(directory)


def test_a_slow_sympy_call_is_cut_off_on_the_main_thread_and_on_a_pool_thread(monkeypatch) -> None:
    monkeypatch.setattr(prime_math, "SYMPY_TIMEOUT_S", 0.2)

    def slow(*_: object) -> bool:
        time.sleep(30)
        return True

    def bounded() -> object:
        return prime_math._bounded(slow, seconds=prime_math.SYMPY_TIMEOUT_S)

    with pytest.raises(prime_math._Timeout):
        bounded()
    caught: list[BaseException] = []

    def on_thread() -> None:
        try:
            bounded()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread's assertion
            caught.append(exc)

    thread = threading.Thread(target=on_thread)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and len(caught) == 1 and isinstance(caught[0], prime_math._Timeout)


def test_the_pool_thread_path_scores_like_the_main_thread() -> None:
    results: list[float] = []
    thread = threading.Thread(target=lambda: results.append(
        prime_math.numina_score("numina_cn_k12", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}")))  # fmt: skip
    thread.start()
    thread.join(60)
    assert results == [1.0]


def test_a_reward_file_importing_verls_prime_math_runs(tmp_path) -> None:
    from mcore_rl.reward.loader import load_reward_function

    path = tmp_path / "prime.py"
    path.write_text(
        "from verl.utils.reward_score import prime_math\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    correct, well_formed, answer = prime_math.compute_score(solution_str, ground_truth)\n"
        "    return {'score': float(correct), 'well_formed': float(well_formed), 'answer': answer}\n"
    )
    fn = load_reward_function(str(path))
    result = fn(data_source="numina_olympiads", solution_str="Step 2: so \\boxed{1/2}", ground_truth="\\frac{1}{2}")
    assert result == {"score": 1.0, "well_formed": 1.0, "answer": "1/2"}
