"""`import verl.utils.reward_score` inside a user's reward file, where verl is not installed: the modules verl's reward
files import, backed by reward/verl_scores.py (the same scores).

    from verl.utils.reward_score import default_compute_score      -> loader.default_compute_score (verl's data sources)
    from verl.utils.reward_score import gsm8k, math_reward, math_dapo, prime_math   (their compute_score, as verl
                                                                                 calls them)

Installed by loader.py before it imports a user's reward file, only when verl itself cannot be imported (an installed
verl is used as it is). Another module of verl's reward_score is refused by name, with our equivalent.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

from mcore_rl.reward import verl_scores

PACKAGE = "verl.utils.reward_score"
_NOT_HERE = {
    "prime_code": "code sources score through the sandbox: mcore_rl.reward.code_reward.code_compute_score",
    "sandbox_fusion": "code sources score through the sandbox: mcore_rl.reward.code_reward.code_compute_score",
    "search_r1_like_qa_em": "no search tool here, so no searchR1_* scorer",
}


def _gsm8k() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.gsm8k", "verl's GSM8K scorer (mcore_rl.reward.verl_scores.gsm8k_score)")

    def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                      score: float = 1.0) -> float:  # fmt: skip
        return verl_scores.gsm8k_score("openai/gsm8k", solution_str, ground_truth, None, method, format_score, score)

    module.compute_score = compute_score
    module.extract_solution = lambda solution_str, method="strict": verl_scores.gsm8k_answer(solution_str, method)
    return module


def _math_reward() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.math_reward", "verl's MATH scorer (verl_scores.hendrycks_math_score)")
    module.compute_score = lambda solution_str, ground_truth: verl_scores.hendrycks_math_score(
        "lighteval/MATH", solution_str, ground_truth
    )
    module.is_equiv = lambda str1, str2, verbose=False: verl_scores.math_equivalent(str1, str2)
    module.last_boxed_only_string = verl_scores.last_boxed
    return module


def _math_dapo() -> types.ModuleType:
    module = types.ModuleType(f"{PACKAGE}.math_dapo", "verl's DAPO math scorer (verl_scores.dapo_score)")

    def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                      pause_tokens_index: Any = None) -> dict[str, Any]:  # fmt: skip
        if pause_tokens_index is not None:
            raise NotImplementedError("math_dapo.compute_score(pause_tokens_index=...) is not supported here")
        return verl_scores.dapo_score("math_dapo", solution_str, ground_truth, None, strict_box_verify)

    module.compute_score = compute_score
    module.normalize_final_answer = verl_scores.minerva_normalise
    return module


def _prime_math() -> types.ModuleType:
    from mcore_rl.reward import verl_math

    module = types.ModuleType(f"{PACKAGE}.prime_math", "verl's numina_* scorer (verl_math.prime_math_result)")
    module.compute_score = verl_math.prime_math_result  # (correct, format correct, extracted answer), as verl's
    module.match_answer = verl_math.match_answer
    module.grade_answer = verl_math.grade_answer
    return module


def _default_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                           **kwargs: Any) -> Any:  # fmt: skip
    from mcore_rl.reward.loader import default_compute_score

    result = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return result if isinstance(result, dict) else float(result)


def install() -> bool:
    """Register the shim in sys.modules unless verl is importable; True when it was installed (now or before)."""
    if PACKAGE in sys.modules:
        return getattr(sys.modules[PACKAGE], "__mcore_rl_shim__", False)
    if importlib.util.find_spec("verl") is not None:
        return False
    verl, utils, package = (types.ModuleType(n) for n in ("verl", "verl.utils", PACKAGE))
    for module in (verl, utils, package):
        module.__path__ = []  # packages, so `import verl.utils.reward_score.gsm8k` resolves through sys.modules
        module.__mcore_rl_shim__ = True
    verl.utils, utils.reward_score = utils, package
    package.default_compute_score = _default_compute_score
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
