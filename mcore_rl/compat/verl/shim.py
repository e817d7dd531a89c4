"""verl's `verl.utils.reward_score`, here: which scorer each of verl's data sources gets (its `default_compute_score`
table), and, where verl is not installed, the modules a user's reward file imports from it, backed by scores.py and
prime_math.py (the same scores).

    SCORERS, PREFIXES                                          -> reward/loader.py's built-ins for verl's data sources
    from verl.utils.reward_score import default_compute_score  -> loader.default_compute_score (verl's data sources)
    from verl.utils.reward_score import gsm8k, math_reward, math_dapo, prime_math   (their compute_score, as verl
                                                                                 calls them)

Installed by reward/loader.py before it imports a user's reward file, only when verl itself cannot be imported (an
installed verl is used as it is). Another module of verl's reward_score is refused by name, with our equivalent.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

from mcore_rl.compat.verl import prime_math, scores

#: data_source values written by verl's preprocessing scripts for GSM8K, MATH and DAPO (exact names)
GSM8K_DATA_SOURCES = ("openai/gsm8k",)
MATH_DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
#: verl's data sources, scored as verl scores them (prime_math.py for verl's six numina_* sources, by exact name as
#: verl lists them); read by the reward loader's built-in table
SCORERS: dict[str, Callable[..., Any]] = {
    **{source: scores.gsm8k_score for source in GSM8K_DATA_SOURCES},
    **{source: scores.hendrycks_math_score for source in MATH_DATA_SOURCES},
    **{source: scores.dapo_score for source in DAPO_DATA_SOURCES},
    **{source: prime_math.numina_score for source in prime_math.NUMINA_DATA_SOURCES},
}
#: data_source prefixes verl scores by one rule (its default_compute_score: `data_source.startswith("aime")`)
PREFIXES: dict[str, Callable[..., Any]] = {"aime": scores.dapo_score}
#: verl's data sources that have no scorer here, and why (pre-flight names them: reward/sources.py)
WITHOUT_SCORER = {
    "numina_": "verl's prime_math scores only its six numina_* sources, "
    "listed in mcore_rl/compat/verl/prime_math.py (NUMINA_DATA_SOURCES)",
    "searchR1_": "verl's searchR1_* sources need a search tool, which the agent tools do not have",
    "hiyouga/geometry3k": "verl's geo3k scorer is for a vision-language dataset (text-only here)",
}

PACKAGE = "verl.utils.reward_score"
_NOT_HERE = {
    "prime_code": "code sources score through the sandbox: mcore_rl.reward.code_reward.code_compute_score",
    "sandbox_fusion": "code sources score through the sandbox: mcore_rl.reward.code_reward.code_compute_score",
    "search_r1_like_qa_em": "no search tool here, so no searchR1_* scorer",
}


def _gsm8k() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.gsm8k", "verl's GSM8K scorer (mcore_rl.compat.verl.scores.gsm8k_score)")

    def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                      score: float = 1.0) -> float:  # fmt: skip
        return scores.gsm8k_score("openai/gsm8k", solution_str, ground_truth, None, method, format_score, score)

    module.compute_score = compute_score
    module.extract_solution = lambda solution_str, method="strict": scores.gsm8k_answer(solution_str, method)
    return module


def _math_reward() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.math_reward", "verl's MATH scorer (scores.hendrycks_math_score)")
    module.compute_score = lambda solution_str, ground_truth: scores.hendrycks_math_score(
        "lighteval/MATH", solution_str, ground_truth
    )
    module.is_equiv = lambda str1, str2, verbose=False: scores.math_equivalent(str1, str2)
    module.last_boxed_only_string = scores.last_boxed
    return module


def _math_dapo() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.math_dapo", "verl's DAPO math scorer (scores.dapo_score)")

    def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                      pause_tokens_index: Any = None) -> dict[str, Any]:  # fmt: skip
        if pause_tokens_index is not None:
            raise NotImplementedError("math_dapo.compute_score(pause_tokens_index=...) is not supported here")
        return scores.dapo_score("math_dapo", solution_str, ground_truth, None, strict_box_verify)

    module.compute_score = compute_score
    module.normalize_final_answer = scores.minerva_normalise
    return module


def _prime_math() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.prime_math", "verl's numina_* scorer (prime_math.prime_math_result)")
    module.compute_score = prime_math.prime_math_result  # (correct, format correct, extracted answer), as verl's
    module.match_answer = prime_math.match_answer
    module.grade_answer = prime_math.grade_answer
    return module


def _verl_default_compute_score(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """verl's `default_compute_score` over `dispatch` (the loader's): a float unless the scorer gave a dict."""

    def _default_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                               **kwargs: Any) -> Any:  # fmt: skip
        result = dispatch(data_source, solution_str, ground_truth, extra_info)
        return result if isinstance(result, dict) else float(result)

    return _default_compute_score


def install(default_compute_score: Callable[..., Any]) -> bool:
    """Register the shim in sys.modules unless verl is importable; True when it was installed (now or before).

    `default_compute_score` is the reward loader's dispatch by data_source (ours and verl's sources), which verl's
    `default_compute_score` calls here; the loader, which installs the shim, passes it in, so the two modules do not
    import each other."""
    if PACKAGE in sys.modules:
        return getattr(sys.modules[PACKAGE], "__mcore_rl_shim__", False)
    if importlib.util.find_spec("verl") is not None:
        return False
    verl, utils, package = (types.ModuleType(n) for n in ("verl", "verl.utils", PACKAGE))
    for module in (verl, utils, package):
        module.__path__ = []  # packages, so `import verl.utils.reward_score.gsm8k` resolves through sys.modules
        module.__mcore_rl_shim__ = True
    verl.utils, utils.reward_score = utils, package
    package.default_compute_score = _verl_default_compute_score(default_compute_score)
    submodules = {
        "gsm8k": _gsm8k(),
        "math_reward": _math_reward(),
        "math": _math_reward(),
        "math_dapo": _math_dapo(),
        "prime_math": _prime_math(),
    }
    for name, module in submodules.items():
        setattr(package, name, module)
        sys.modules[f"{PACKAGE}.{name}"] = module

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        reason = _NOT_HERE.get(name, f"the shim holds {sorted(submodules)} and default_compute_score")
        raise ImportError(f"{PACKAGE}.{name} is not available here (verl is not installed): {reason}")

    package.__getattr__ = missing
    sys.modules.update({"verl": verl, "verl.utils": utils, PACKAGE: package})
    return True
