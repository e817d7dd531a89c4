"""Find the reward function for a run: a user's function (verl's `custom_reward_function`) or a built-in.

    config (path, name, reward_kwargs) -> load_reward_function -> checked callable (signature bound up front)
    no path                            -> default_compute_score -> BUILTIN_REWARDS[data_source]

A user function is given as `path/to/file.py:function_name`, as `package.module:function_name`, or in verl's two
fields (`path` = a .py file or module, `name` = the function, default "compute_score"). It must accept verl's
keywords `data_source, solution_str, ground_truth, extra_info` (functions written before verl passed `extra_info`
are accepted and called without it). Every failure names the file or module, the function, and what was expected.

Built-ins are keyed by exact `data_source` strings (never substring matches), so an unknown data source fails
loudly with the list of known ones instead of being scored by the wrong rule.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from mcore_rl.reward import code_reward, rule

RewardResult = float | dict[str, Any]


@runtime_checkable
class RewardFn(Protocol):
    """One response -> a score, verl's rule-reward signature.

    Returns a float, or a dict with a "score" float plus any extra metrics. This is the seam for the rewards not
    built yet: a reward-model client or a sandboxed code runner implements the same call (or `BatchRewardFn` in
    `manager.py` to score a whole batch at once).
    """

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
    ) -> RewardResult: ...


class RewardFunctionError(ValueError):
    """A reward function could not be loaded or returned something unusable; the message says which and why."""


# The keywords verl passes; a user function must accept them (extra_info may be missing, see module docstring).
_REQUIRED_KEYWORDS = ("data_source", "solution_str", "ground_truth")
EXPECTED_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"

SYNTHETIC_DATA_SOURCES = ("synthetic/copy_digit", "synthetic/copy_digits", "synthetic/successor")

# Built-ins by exact data_source, and data_source prefixes scored by one rule: ours here; verl's data sources (GSM8K,
# MATH, DAPO, AIME, numina_*) join from compat/verl/shim.py when a table is first read (`_builtins`). Read them as
# BUILTIN_REWARDS and BUILTIN_PREFIXES (module attributes, verl's joined). verl's searchR1_* (needs a search tool) has
# no scorer here: pre-flight names it (reward/sources.py).
_REWARDS: dict[str, RewardFn] = {
    **{source: rule.synthetic_digits_score for source in SYNTHETIC_DATA_SOURCES},
    "synthetic/lookup": rule.synthetic_lookup_score,
    "arith/add": rule.arithmetic_score,  # data/arithmetic.py: the real-model recipe
    **{source: code_reward.code_compute_score for source in code_reward.CODE_DATA_SOURCES},
}
_PREFIXES: dict[str, RewardFn] = {}
_verl_joined = False
_join_lock = threading.Lock()


def _builtins() -> tuple[dict[str, RewardFn], dict[str, RewardFn]]:
    """(exact data_source -> scorer, prefix -> scorer), verl's data sources joined on the first call.

    verl's scorers live in the compat layer above this one, so the tables take them in when first read rather than
    when this module is imported (tests/test_layers.py lists this one edge up from reward/ to compat/).
    """
    global _verl_joined
    if not _verl_joined:
        with _join_lock:  # the reward manager's threads may read the tables first
            if not _verl_joined:
                from mcore_rl.compat.verl.shim import PREFIXES, SCORERS

                _REWARDS.update(SCORERS)
                _PREFIXES.update(PREFIXES)
                _verl_joined = True
    return _REWARDS, _PREFIXES


def __getattr__(name: str) -> Any:
    """BUILTIN_REWARDS and BUILTIN_PREFIXES: the built-in tables with verl's data sources joined (see `_builtins`)."""
    if name == "BUILTIN_REWARDS":
        return _builtins()[0]
    if name == "BUILTIN_PREFIXES":
        return _builtins()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def builtin_reward(data_source: str) -> RewardFn | None:
    """The built-in scorer of `data_source`: an exact entry of BUILTIN_REWARDS, else verl's prefix rules."""
    rewards, prefixes = _builtins()
    fn = rewards.get(data_source)
    if fn is None:
        fn = next((f for prefix, f in prefixes.items() if data_source.startswith(prefix)), None)
    return fn


def register_reward(data_source: str, fn: RewardFn, overwrite: bool = False) -> None:
    """Add a built-in reward for an exact `data_source`; refuses to replace one unless `overwrite`."""
    rewards, _ = _builtins()
    if data_source in rewards and not overwrite:
        raise ValueError(f"a reward for data_source={data_source!r} is already registered (pass overwrite=True)")
    check_signature(fn, f"reward for data_source={data_source!r}")
    rewards[data_source] = fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> RewardResult:
    """Score with the built-in registered for `data_source`; the error lists the registered data sources."""
    fn = builtin_reward(data_source)
    if fn is None:
        rewards, prefixes = _builtins()
        raise RewardFunctionError(
            f"no built-in reward for data_source={data_source!r}; known: {sorted(rewards)} and "
            f"{[p + '*' for p in prefixes]}. "
            "Set reward.custom_reward_function.path to a file with a compute_score function, or register one."
        )
    return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)


def check_signature(fn: Callable[..., Any], where: str) -> bool:
    """Check that `fn` can be called with verl's reward keywords.

    Returns True when it accepts `extra_info`, False when it accepts only the other three (older verl functions).
    Raises `RewardFunctionError` naming `where` and the expected signature otherwise.
    """
    if not callable(fn):
        raise RewardFunctionError(
            f"{where} is not callable (it is a {type(fn).__name__}); expected {EXPECTED_SIGNATURE}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # some builtins and C functions have no signature to inspect; trust them
    keywords = {name: "" for name in _REQUIRED_KEYWORDS}
    try:
        signature.bind(**keywords, extra_info=None)
        return True
    except TypeError:
        pass
    try:
        signature.bind(**keywords)
        return False
    except TypeError as exc:
        raise RewardFunctionError(
            f"{where} has signature {signature}, which cannot be called as {EXPECTED_SIGNATURE} ({exc})"
        ) from exc


def _import_file(path: str) -> Any:
    """Import a .py file as a module under a name derived from its absolute path (no clash with other modules)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise RewardFunctionError(f"reward function file not found: {path}")
    from mcore_rl.compat.verl.shim import install

    install(default_compute_score)  # `import verl.utils.reward_score` in the file works without verl
    module_name = "mcore_rl_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"cannot import reward function file {path} (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    # Registered before exec so that pickling the function (process pools, Ray) can find its module by name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardFunctionError(f"importing reward function file {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RewardFunctionError(f"cannot import reward function module {name!r}: {exc}") from exc


def parse_reward_spec(path: str, name: str | None = None) -> tuple[str, str]:
    """Split a spec into (file or module, function name): "f.py:fn", "pkg.mod:fn", or `path` + `name`."""
    if ":" in path:
        location, _, function_name = path.rpartition(":")
        if name is not None and name != function_name:
            raise RewardFunctionError(f"reward spec {path!r} names function {function_name!r} but name={name!r}")
        name = function_name
    else:
        location = path
    if not location or not name:
        raise RewardFunctionError(f"reward spec {path!r}: expected 'path/to/file.py:function' or 'module:function'")
    return location, name


def load_reward_function(path: str, name: str | None = None, reward_kwargs: dict[str, Any] | None = None) -> RewardFn:
    """Load and check a user reward function (verl's `custom_reward_function.path` / `.name` / `.reward_kwargs`).

    Args:
        path: "path/to/file.py:function_name", "package.module:function_name", a .py file, or a module name.
        name: the function's name when `path` does not carry one (verl's default is "compute_score").
        reward_kwargs: extra keyword arguments bound to every call (e.g. {"method": "flexible"}).

    Returns:
        A callable with verl's keyword signature; `extra_info` is dropped for functions that do not take it.
    """
    if name is None and ":" not in path:
        name = "compute_score"
    location, function_name = parse_reward_spec(path, name)
    is_file = location.endswith(".py") or os.sep in location
    module = _import_file(location) if is_file else _import_module(location)
    where = f"{location}:{function_name}"
    if not hasattr(module, function_name):
        candidates = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFunctionError(f"{location} has no function {function_name!r}; callables there: {candidates}")
    fn = getattr(module, function_name)
    if inspect.iscoroutinefunction(fn):  # verl awaits `async def` reward functions; so does this wrapper
        fn = _awaited(fn)
    if reward_kwargs:
        fn = functools.partial(fn, **reward_kwargs)
    takes_extra_info = check_signature(fn, where)
    if takes_extra_info:
        return fn

    def without_extra_info(
        data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
    ) -> RewardResult:
        return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth)

    # Named after the user's function so that errors raised while scoring point at it.
    without_extra_info.__name__ = without_extra_info.__qualname__ = function_name
    return without_extra_info


def _awaited(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An `async def` reward function as a plain one: each call runs the coroutine to its end on its own event loop
    (calls come from the reward manager's threads, which run no loop of their own)."""
    import asyncio

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the usual case
            return asyncio.run(fn(*args, **kwargs))
        # called from inside a running loop (asyncio.run would refuse): its own loop on a helper thread
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, fn(*args, **kwargs)).result()

    return call


def build_reward_fn(
    path: str | None = None, name: str | None = None, reward_kwargs: dict[str, Any] | None = None
) -> RewardFn:
    """The run's reward function: the user's when `path` is set, else dispatch to built-ins by data_source."""
    if path:
        return load_reward_function(path, name, reward_kwargs)
    if reward_kwargs:
        raise RewardFunctionError("reward_kwargs were given without a custom reward function path")
    return default_compute_score
