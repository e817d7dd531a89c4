"""Code reward: run the program in a response on its test cases in a sandbox; score the fraction that pass.

    response -> extract_code (last ```python block) -> one program per test case -> SandboxPool(runner) -> compare
             -> {"score", "pass_rate", "passed", "total", "reason"}

The test cases come from `reward_model.ground_truth` (a JSON string or a dict), else from `extra_info["test_cases"]`,
in the formats of verl's code datasets:
- stdin/stdout: {"inputs": [str], "outputs": [str]} (APPS, TACO, CodeContests, Codeforces; verl's
  verl/utils/reward_score/prime_code/testing_util.py and sandbox_fusion/utils.py). Passes when stdout equals the
  output line by line after trailing whitespace is stripped from each line and trailing blank lines are dropped.
- function call: the same plus "fn_name" (LeetCode style, LiveCodeBench). An input is a list of arguments, or a
  string holding one JSON value per line (testing_util.py: `[json.loads(line) for line in inputs.split("\\n")]`);
  an output is the return value, as a value or a JSON string. The function is a global or a method of `Solution`;
  it passes when its return value (tuples as lists) equals the output, or the output's only element when the output
  is a one-element list (APPS wraps them so). As verl does, common imports (typing, collections, math...) are
  prepended, since LeetCode-style code uses `List[int]` without importing it.
- asserts: {"test_list": ["assert f(1) == 2", ...]} (MBPP; optional "test_setup_code") or {"test": "...",
  "entry_point": "f"} (HumanEval; `check(f)` is called). Each assert (or the whole test) is appended to the program;
  it passes when the program exits 0.
Every case gets a stated reason (wrong answer, timeout, memory, error with its last stderr line, ...).

`SandboxFusionRunner` runs the same programs on a SandboxFusion server (https://github.com/bytedance/SandboxFusion,
sandbox/server/sandbox_api.py), with the request verl's sandbox_fusion/utils.py `call_sandbox_api` sends:
    POST {url}/run_code {"code", "language": "python", "stdin", "compile_timeout", "run_timeout",
                         "memory_limit_MB", "files": {}, "fetch_files": []}
    -> {"status": "Success" | "Failed" | "SandboxError", "message", "compile_result": null,
        "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code",
                       "stdout", "stderr"}}
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.reward.sandbox import CodeRunner, Sandbox, SandboxJob, SandboxPool, SandboxResult, last_line

# data_source values of verl's code datasets (verl/utils/reward_score/__init__.py default_compute_score).
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")

_RESULT_MARKER = "@@mcore_rl_result@@ "
_PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\n"
    "import collections, functools, heapq, bisect, itertools, math, re, string, sys\n"
)
# Appended to the program of a function-call case; the arguments are a literal, so stdin stays the program's own.
_CALL_DRIVER = """

import json as _json
_fn = globals().get({name})
if _fn is None and "Solution" in globals():
    _fn = getattr(globals()["Solution"](), {name})
if _fn is None:
    raise NameError("function " + {name} + " is not defined")
_r = _fn(*_json.loads({args}))
print({marker} + _json.dumps(list(_r) if isinstance(_r, tuple) else _r, default=repr))
"""
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The program in a response: the last ```python block, else the last fenced block, else the whole text.

    `<think>...</think>` is removed first. A response without fences is taken as code, as verl does.
    """
    text = _THINK.sub("", response)
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


@dataclass
class CodeCase:
    """One program to run and how to judge it."""

    kind: str
    """"stdio" (compare stdout), "call" (compare the returned value) or "assert" (exit 0 passes)."""
    program: str
    stdin: str
    expected: Any
    label: str
    """Short description for reasons: "case 3 (stdin/stdout)"."""


def load_test_spec(ground_truth: Any, extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The test-case dict of a row; raises ValueError naming what was expected."""
    spec = ground_truth
    if (spec is None or spec == "") and extra_info:
        spec = extra_info.get("test_cases")
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"code reward: ground_truth is not JSON test cases ({exc}): {str(spec)[:100]!r}") from exc
    if not isinstance(spec, dict):
        raise ValueError(f"code reward: test cases must be a JSON object, got {type(spec).__name__}")
    if "inputs" in spec or "outputs" in spec:
        inputs, outputs = spec.get("inputs"), spec.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("code reward: 'inputs' and 'outputs' must be lists of the same length")
    elif not ("test_list" in spec or "test" in spec):
        raise ValueError(
            f"code reward: test cases need 'inputs'/'outputs' (with optional 'fn_name'), 'test_list' or 'test'; "
            f"got keys {sorted(spec)}"
        )
    return spec


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _call_args(value: Any) -> list:
    if isinstance(value, str):  # LiveCodeBench: one JSON value per line
        return [json.loads(line) for line in value.split("\n") if line.strip()]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def build_cases(code: str, spec: dict[str, Any], max_cases: int | None = None) -> list[CodeCase]:
    """One `CodeCase` per test in `spec` (see `load_test_spec`), at most `max_cases` (the first ones)."""
    cases: list[CodeCase] = []
    if "inputs" in spec:
        fn_name = spec.get("fn_name")
        for i, (given, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
            if fn_name:
                args = json.dumps(_call_args(given))
                driver = _CALL_DRIVER.format(name=repr(fn_name), args=repr(args), marker=repr("\n" + _RESULT_MARKER))
                program = _PRELUDE + code + driver
                cases.append(CodeCase("call", program, "", _maybe_json(expected), f"case {i} (call {fn_name})"))
            else:
                cases.append(CodeCase("stdio", code, _as_text(given), _as_text(expected), f"case {i} (stdin/stdout)"))
    else:
        setup = spec.get("test_setup_code") or ""
        if "test_list" in spec:
            for i, test in enumerate(spec["test_list"]):
                cases.append(CodeCase("assert", f"{code}\n\n{setup}\n{test}\n", "", None, f"case {i} (assert)"))
        else:
            check = f"\ncheck({spec['entry_point']})\n" if spec.get("entry_point") else ""
            cases.append(CodeCase("assert", f"{code}\n\n{setup}\n{spec['test']}\n{check}", "", None, "case 0 (test)"))
    return cases[:max_cases] if max_cases is not None else cases


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge(case: CodeCase, result: SandboxResult) -> tuple[bool, str]:
    """(passed, reason) of one case from its sandbox result."""
    if result.status != "ok":
        return False, f"{result.status}: {result.reason}"
    if case.kind == "assert":
        return True, "passed"
    if case.kind == "stdio":
        if _normalise_output(result.stdout) == _normalise_output(case.expected):
            return True, "passed"
        return False, f"wrong answer: got {result.stdout[:80]!r}, expected {case.expected[:80]!r}"
    found = [line for line in result.stdout.splitlines() if line.startswith(_RESULT_MARKER)]
    if not found:
        return False, "wrong answer: the function returned nothing (the program ended before the call)"
    try:
        value = json.loads(found[-1][len(_RESULT_MARKER) :])
    except json.JSONDecodeError:
        return False, "wrong answer: the return value is not JSON"
    expected = case.expected
    if value == expected or (isinstance(expected, list) and len(expected) == 1 and value == expected[0]):
        return True, "passed"
    return False, f"wrong answer: returned {str(value)[:80]}, expected {str(expected)[:80]}"


class CodeReward:
    """Scores responses by running their code on the row's test cases; a `RewardFn` and a `BatchRewardFn`."""

    def __init__(
        self,
        runner: CodeRunner | None = None,
        *,
        max_workers: int = 4,
        all_or_nothing: bool = False,
        max_cases: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Args:
        runner: where programs run; None builds the local `Sandbox()` and checks it (raises `SandboxUnavailable`
            naming what is missing, so training never starts with code running unconfined).
        max_workers: programs running at once (each in its own sandbox).
        all_or_nothing: score 1 only when every case passes; otherwise the fraction passed (partial credit).
        max_cases: run only the first this many cases of a row (verl's "continuous" mode uses 10); None: all.
        timeout_s: per-case wall clock, overriding the runner's default.
        """
        if max_cases is not None and max_cases < 1:
            raise ValueError(f"CodeReward.max_cases must be >= 1 or None, got {max_cases}")
        if runner is None:
            runner = Sandbox()
            runner.check()
        self.runner = runner
        self.pool = SandboxPool(runner, max_workers)
        self.all_or_nothing = all_or_nothing
        self.max_cases = max_cases
        self.timeout_s = timeout_s

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.score_batch([data_source], [solution_str], [ground_truth], [extra_info])[0]

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[dict[str, Any]]:
        """All cases of all rows go through one pool, so a batch keeps `max_workers` sandboxes busy."""
        row_cases: list[list[CodeCase]] = []
        for row, (response, truth, extra) in enumerate(zip(solution_strs, ground_truths, extra_infos)):
            try:
                row_cases.append(build_cases(extract_code(response), load_test_spec(truth, extra), self.max_cases))
            except ValueError as exc:  # the dataset's test cases are malformed: stop, naming the row
                raise ValueError(f"row {row} (data_source={data_sources[row]!r}): {exc}") from exc
        jobs = [SandboxJob(case.program, case.stdin, self.timeout_s) for cases in row_cases for case in cases]
        results = iter(self.pool.run_many(jobs))
        return [self._score([(case, *judge(case, next(results))) for case in cases]) for cases in row_cases]

    def _score(self, judged: list[tuple[CodeCase, bool, str]]) -> dict[str, Any]:
        total = len(judged)
        passed = sum(ok for _, ok, _ in judged)
        pass_rate = passed / total if total else 0.0
        score = float(passed == total and total > 0) if self.all_or_nothing else pass_rate
        failures = [f"{case.label}: {why}" for case, ok, why in judged if not ok]
        reason = f"{passed}/{total} cases passed" + ("; " + "; ".join(failures[:3]) if failures else "")
        if len(failures) > 3:
            reason += f"; ... {len(failures) - 3} more failed"
        return {"score": score, "pass_rate": pass_rate, "passed": passed, "total": total, "reason": reason}

    def close(self) -> None:
        self.pool.close()


class SandboxFusionRunner:
    """A `CodeRunner` on a SandboxFusion server: verl's optional remote backend (see the module docstring)."""

    def __init__(
        self, url: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, retries: int = 3, retry_delay_s: float = 1.0
    ) -> None:
        """`url`: the server ("http://host:8080") or its /run_code endpoint, as verl's `sandbox_fusion_url`."""
        if retries < 1:
            raise ValueError(f"SandboxFusionRunner.retries must be >= 1, got {retries}")
        self.url = url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
        self.timeout_s, self.memory_mb, self.retries, self.retry_delay_s = timeout_s, memory_mb, retries, retry_delay_s

    def run(self, program: str, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        payload = {
            "code": program,
            "language": "python",
            "stdin": stdin,
            "compile_timeout": timeout_s,
            "run_timeout": timeout_s,
            "memory_limit_MB": self.memory_mb,
            "files": {},
            "fetch_files": [],
        }
        request = urllib.request.Request(
            self.url,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        start = time.monotonic()
        for attempt in range(self.retries):
            try:
                with urllib.request.urlopen(request, timeout=2 * timeout_s + 10) as response:
                    body = json.loads(response.read())
                break
            except urllib.error.HTTPError as exc:
                # A busy gateway (as verl retries 504): try again after a growing pause; anything else is final.
                if exc.code in (502, 503, 504) and attempt + 1 < self.retries:
                    time.sleep(self.retry_delay_s * (attempt + 1))
                    continue
                return SandboxResult("refused", None, "", "", f"SandboxFusion at {self.url}: HTTP {exc.code}")
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
                return SandboxResult("refused", None, "", "", f"SandboxFusion at {self.url}: {exc}")
        result = self._result(body)
        result.wall_s = round(time.monotonic() - start, 3)
        return result

    def _result(self, body: dict[str, Any]) -> SandboxResult:
        status = body.get("status")
        run = body.get("run_result") or {}
        compiled = body.get("compile_result") or {}
        code, stdout, stderr = run.get("return_code"), run.get("stdout") or "", run.get("stderr") or ""

        def result(kind: str, reason: str) -> SandboxResult:
            return SandboxResult(kind, code, stdout, stderr, reason)

        if status == "SandboxError":
            return result("refused", f"SandboxFusion SandboxError: {body.get('message') or 'no message'}")
        if status not in ("Success", "Failed"):
            return result("refused", f"SandboxFusion answered an unknown status {status!r}")
        if compiled.get("status") not in (None, "Finished") or compiled.get("return_code") not in (None, 0):
            return result("error", f"compilation failed: {last_line(compiled.get('stderr') or '')}")
        if run.get("status") == "TimeLimitExceeded":
            return result("timeout", "SandboxFusion: run_result TimeLimitExceeded")
        if status == "Success" and run.get("status") == "Finished":
            return result("ok", "exited 0")
        last = last_line(stderr)
        if "MemoryError" in last:
            return result("memory", f"memory limit of {self.memory_mb} MiB exceeded: {last}")
        return result("error", f"exited {code}: {last or 'no stderr'}")


_default_reward: CodeReward | None = None
_default_lock = threading.Lock()


def code_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The built-in reward for `CODE_DATA_SOURCES`: a local sandbox (checked on first use), fraction of cases passed."""
    global _default_reward
    with _default_lock:
        if _default_reward is None:
            _default_reward = CodeReward()
    return _default_reward(data_source, solution_str, ground_truth, extra_info)
