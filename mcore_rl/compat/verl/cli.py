"""Reading a command line: our keys as they are, verl's through the table in compat/verl/keys.py, every problem at once.

    translate(argv)   -> Translation: our settings (key -> value), one line per verl key, every error
    compose(t)        -> the DictConfig of the run (schema <- verl's defaults <- the command), to_config's input
    resolve(argv)     -> translate, plus the Hydra arguments of a command of ours (base_of: which base it composes over)
    compose_command(argv) -> the validated RLConfig the command runs (train and launch/submit.py --dry-run share it)

A command is a verl command when it names a key that only verl has (or verl's --config-name); then verl's defaults
apply under what it sets and the tiny CPU job of configs/default.yaml is not read at all. Otherwise the command is
ours and goes to Hydra as before, after every unknown key has been reported (with "verl's X is Y here" hints).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.compat.verl import keys as V
from mcore_rl.compat.verl.derive import derive


@dataclass
class Translation:
    """What a command line asks, in our keys."""

    verl: bool = False  #: the command used verl's keys (verl's defaults apply)
    settings: dict[str, Any] = field(default_factory=dict)  #: our key -> value, in the order they apply
    lines: list[str] = field(default_factory=list)  #: one per verl key: what it became or why it is ignored
    errors: list[str] = field(default_factory=list)  #: every problem of the command, each naming its key
    hydra_args: list[str] = field(default_factory=list)  #: flags kept for Hydra (commands of ours)


def schema_field(key: str) -> bool:
    """Whether `key` names a field of our schema (or sits below a free-form dict field such as model.hf_config)."""
    from mcore_rl.config import RLConfig

    node: Any = RLConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return node in (dict, Any) or typing.get_origin(node) is dict
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        hint = typing.get_type_hints(node)[part]
        node = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
    return True


def field_hint(key: str) -> Any:
    """The type hint of our field `key` (None when it is not a field of the schema's dataclasses)."""
    from mcore_rl.config import RLConfig

    node: Any = RLConfig
    hint: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return None
        hint = typing.get_type_hints(node)[part]
        node = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
    return hint


def _list_of_str(key: str) -> bool:
    """Whether our field `key` is a list of strings (data.train_files, trainer.loggers, ...)."""
    hint = field_hint(key)
    for option in (hint, *typing.get_args(hint)):
        if typing.get_origin(option) is list and typing.get_args(option) in ((str,), ()):
            return True
    return False


#: what a value of our field's type is, in the words of an error message
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _expected(key: str) -> str:
    """What our field `key` takes, for an error message ("an integer", "a number or null", ...)."""
    hint = field_hint(key)
    args = typing.get_args(hint)
    plain = [a for a in args if a is not type(None)] if args else [hint]
    words = " or ".join(_EXPECTED.get(a, getattr(a, "__name__", str(a))) for a in plain)
    return words + (" or null" if type(None) in args else "")


def type_problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for our field `key` by its type alone (the check Hydra and OmegaConf make when the
    config is composed), or None. Checked as each key is read, so a value of the wrong type is named as itself before
    any problem it causes downstream."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mcore_rl.config import RLConfig

    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = OmegaConf.structured(RLConfig)
    try:
        OmegaConf.update(_SCHEMA, key, value, merge=False)  # a scratch tree: only whether OmegaConf takes it
    except (OmegaConfBaseException, ValueError):
        return f"expected {_expected(key)}"
    return None


_SCHEMA: Any = None  #: the schema as an OmegaConf tree (a scratch copy, built once per process) for type_problem


def listify(args: list[str]) -> list[str]:
    """Overrides of ours that give a list-of-strings field one plain string (`data.train_files=/x.parquet`, as verl
    users write it) rewritten to the one-element list Hydra accepts; every other argument as it is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for arg in args:
        out.append(arg)
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - Hydra reports it, with its own words, when it composes the command
            continue
        value = override.value()
        if override.is_delete() or not isinstance(value, str) or not _list_of_str(override.key_or_group):
            continue
        # Hydra's quoted string: a quote is escaped by a backslash, and backslashes before a quote (or the closing
        # quote) are doubled
        quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        quoted = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted)
        rewritten = f"{arg.split('=', 1)[0]}=['{quoted}']"
        try:
            if parser.parse_override(rewritten).value() == [value]:
                out[-1] = rewritten
        except Exception:  # noqa: BLE001 - left as given: Hydra names the problem
            pass
    return out


def our_keys() -> list[str]:
    """Every leaf key of our schema (for suggestions)."""
    from mcore_rl.config import RLConfig

    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            sub = next((a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)), hints[f.name])
            if dataclasses.is_dataclass(sub):
                walk(sub, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")

    walk(RLConfig, "")
    return out


def _verl_only(key: str) -> bool:
    return V.lookup(key) is not None and not schema_field(key)


def _parse(args: list[str]) -> tuple[list[tuple[str, Any, str]], list[str], list[str]]:
    """Hydra's override grammar, as verl reads its command line: (key, value, text) per override, flags, errors."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out, flags, errors = [], [], []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            flags.append(arg)
            continue
        try:
            override = parser.parse_override(arg)
        except Exception as err:  # noqa: BLE001 - Hydra's grammar errors have several types
            errors.append(f"{arg!r} is not an override Hydra (and so verl) can read: {str(err).splitlines()[0]}")
            continue
        key = ("++" if override.is_force_add() else "+" if override.is_add() else "") + override.key_or_group
        if override.is_delete():
            errors.append(f"{arg!r}: deleting a key ('~') is not supported; expected key=value")
            continue
        out.append((key, override.value(), arg))
    return out, flags, errors


def _unknown(key: str, plus: bool) -> str:
    """The message of a key neither we nor verl have: where the schema stops knowing it, and the closest key."""
    parts = key.split(".")
    known = next((i for i in range(len(parts), 0, -1) if schema_field(".".join(parts[:i]))), 0)
    where = ".".join(parts[:known]) or "the config"
    hint = " ('+' adds keys; this schema has a fixed set)" if plus else ""
    return f"unknown key {key!r}{hint}: {where} has no field {parts[known]!r}; {_suggest(key)}"


def _suggest(key: str) -> str:
    """The closest verl or our key, with what a verl key is here."""
    candidates = [*V.VERL_KEYS, *our_keys()]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if not close:
        return "expected a field of mcore_rl/config/ or a verl key of compat/verl/keys.py (docs/coming_from_verl.md)"
    match = close[0]
    rule = V.VERL_KEYS.get(match)
    if rule is not None and not schema_field(match):
        return f"did you mean {match}? (verl's {match} is {_what(rule)} here)"
    return f"did you mean {match}?"


def _what(rule: V.Rule) -> str:
    if isinstance(rule, (V.Map, V.Derived)):
        return rule.ours
    if isinstance(rule, V.Ignore):
        return f"ignored ({rule.reason})"
    return f"refused ({rule.lost})"


def translate(args: list[str]) -> Translation:
    """Classify every override of a command line; see the module docstring."""
    overrides, flags, errors = _parse(args)
    t = Translation(errors=errors)
    config_name = None
    for i, flag in enumerate(flags):
        name = flag.split("=", 1)[1] if flag.startswith("--config-name=") else None
        if flag == "--config-name" and i + 1 < len(args):
            name = args[args.index(flag) + 1]
        if name is not None and name.removesuffix(".yaml") in V.VERL_CONFIG_NAMES:
            config_name = name.removesuffix(".yaml")
    t.verl = config_name is not None or any(_verl_only(key.lstrip("+")) for key, _, _ in overrides)
    if not t.verl:
        for key, _, _ in overrides:
            bare = key.lstrip("+")
            if bare == "hydra" or bare.startswith(("hydra.", "hydra/")) or schema_field(bare):
                continue
            t.errors.append(_unknown(bare, key.startswith("+") and not key.startswith("++")))
        t.hydra_args = list(args)
        return t
    if config_name is not None:
        t.lines.append(f"--config-name={config_name}: {V.VERL_CONFIG_NAMES[config_name]}")
    for flag in flags:
        name = flag.split("=", 1)[1] if flag.startswith("--config-name=") else flag
        if flag in ("--config-name", "--config-path") or flag.startswith("--config-path="):
            continue
        if name.removesuffix(".yaml") in V.VERL_CONFIG_NAMES:
            continue  # verl's config names (as --config-name=X, or the word after --config-name)
        if flag.startswith("--config-name=") or not flag.startswith("-"):
            t.errors.append(
                f"--config-name {name!r} with verl's keys: a verl command is composed over verl's defaults; expected "
                f"one of {tuple(V.VERL_CONFIG_NAMES)} or no --config-name"
            )
        else:
            t.errors.append(f"{flag!r}: not a flag a verl command takes here; expected key=value overrides")

    given: dict[str, Any] = {}  # verl keys read by derive(), as the command gave them
    ours_given: dict[str, Any] = {}  # our keys the command names, as it gave them
    mapped: dict[str, tuple[str, Any]] = {}  # our key -> (the last verl key mapped to it, the value it gave)
    for key, value, _text in overrides:
        bare = key.lstrip("+")
        rule = V.lookup(bare)
        if bare == "hydra" or bare.startswith(("hydra.", "hydra/")):
            t.lines.append(f"{bare}: ignored: Hydra's own settings (a verl command is not composed by Hydra here)")
            continue
        if rule is None and schema_field(bare):
            if isinstance(value, str) and _list_of_str(bare):
                value = [value]  # trainer.loggers=console: a list of one, as verl reads its own lists
            problem = type_problem(bare, value)
            if problem:
                t.errors.append(f"{bare}={value!r} is invalid: {problem}")
                continue
            t.settings[bare] = value  # one of ours, in a verl command
            ours_given[bare] = value
            continue
        if rule is None:
            t.errors.append(_unknown(bare, key.startswith("+") and not key.startswith("++")))
            continue
        given[bare] = value
        if isinstance(rule, V.Refuse):
            t.errors.append(f"verl's {bare}={value!r} cannot be honoured here: {rule.lost}")
        elif isinstance(rule, V.Ignore):
            if rule.accept is not None and not rule.accept(value):
                t.errors.append(
                    f"verl's {bare}={value!r} cannot be honoured here: {rule.lost or 'not supported'}; expected a "
                    f"value that asks for what this build does ({rule.reason}), or the key left out"
                )
            else:
                t.lines.append(f"{bare}={value!r}: ignored: {rule.reason}")
        elif isinstance(rule, V.Map):
            try:
                converted = rule.convert(value) if rule.convert else value
            except V.VerlValueError as err:
                t.errors.append(f"verl's {bare}={value!r} (our {rule.ours}) is invalid: expected {err}")
                continue
            problem = type_problem(rule.ours, converted)
            if problem:
                t.errors.append(f"verl's {bare}={value!r} (our {rule.ours}) is invalid: {problem}")
                continue
            t.settings[rule.ours] = converted
            if rule.ours != bare:
                mapped[rule.ours] = (bare, converted)
            note = f" ({rule.note})" if rule.note else ""
            t.lines.append(f"{bare}={value!r} -> {rule.ours}={converted!r}{note}")
    for ours, value in ours_given.items():  # one setting named twice: neither may silently win over the other
        if ours in mapped and mapped[ours][1] != value:
            verl_key, verl_value = mapped[ours]
            t.errors.append(
                f"{ours}={value!r} and verl's {verl_key}={verl_value!r} are one setting ({ours}) with two values; "
                "expected one of the two keys, or the same value in both"
            )
    derived, lines, problems = derive(given, t.settings, megatron=config_name == "ppo_megatron_trainer" or any(
        ".megatron." in key for key, _, _ in overrides))  # fmt: skip
    t.lines.extend(lines)
    t.errors.extend(problems)
    for key, value in derived.items():
        t.settings.setdefault(key, value)  # a key of ours in the command wins over what verl's keys derive
    placement = t.settings.get("trainer.placement", V.VERL_DEFAULTS["trainer.placement"][0])
    runtime = t.settings.get("trainer.runtime", V.VERL_DEFAULTS["trainer.runtime"][0])
    if placement == "colocated" and runtime == "cuda" and "sync.transport" not in t.settings:
        # the schema's default (distributed: NCCL broadcast) cannot serve verl's hybrid engine: NCCL refuses an actor
        # rank and an engine rank of one group on one GPU, so every colocated verl run would be refused
        t.settings["sync.transport"] = "tensor"
        t.lines.append(
            "sync.transport=tensor: verl's hybrid engine (colocated) shares each GPU between an actor rank and an "
            "engine rank; the weights go by CUDA IPC"
        )
    return t


def compose(t: Translation) -> Any:
    """The run's DictConfig: our schema, verl's defaults, then the command's settings (errors appended to t)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mcore_rl.config import RLConfig

    cfg = OmegaConf.structured(RLConfig)
    layers = [({k: v for k, (v, _) in V.VERL_DEFAULTS.items()}, "verl's default"), (t.settings, "the command")]
    for settings, origin in layers:
        for key, value in settings.items():
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except (OmegaConfBaseException, ValueError) as err:
                t.errors.append(f"{key}={value!r} ({origin}) is invalid: {str(err).splitlines()[0]}")
    return cfg


def expand(path: str) -> str:
    """~ and $VARS in a path, as the shell of verl's scripts expands them."""
    return os.path.expanduser(os.path.expandvars(path))


#: Hydra settings of configs/default.yaml, for a command composed over the schema alone (rl_schema has none)
HYDRA_SETTINGS = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra.job.chdir=false", "hydra/job_logging=stdout"]

#: printed when a command of ours is composed over the schema's defaults
SCHEMA_BASE_NOTE = (
    "model.path names the model: composed over mcore_rl/config/'s defaults, not configs/default.yaml's tiny job"
)


def base_of(args: list[str]) -> list[str]:
    """Hydra arguments put before a command of ours: a command that names its model (model.path) without a recipe is
    composed over the schema's defaults, so the tiny CPU job of configs/default.yaml (its model, EP 2, lr 2e-3,
    micro-batch 32) does not leak into it; otherwise none (configs/default.yaml or the named recipe)."""
    recipe = any(a in ("--config-name", "-cn") or a.startswith(("--config-name=", "-cn=")) for a in args)
    if recipe or not any(a.startswith("model.path=") for a in args):
        return []
    return ["--config-name=rl_schema", *HYDRA_SETTINGS]


def split_config_name(args: list[str]) -> tuple[str, list[str]]:
    """Pull Hydra's `--config-name X` / `--config-name=X` / `-cn X` out of the arguments (default: "default")."""
    name, rest, i = "default", [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config-name", "-cn") and i + 1 < len(args):
            name, i = args[i + 1], i + 2
            continue
        if arg.startswith(("--config-name=", "-cn=")):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def resolve(args: list[str]) -> Translation:
    """What `python -m mcore_rl.train <args>` composes: the translation of a verl command, or, for a command of ours,
    the Hydra arguments (t.hydra_args: the base of `base_of`, then the command). The one decision train and
    launch/submit.py share."""
    t = translate(args)
    if not t.verl:
        t.hydra_args = [*base_of(args), *listify(args)]
    return t


def compose_command(args: list[str], t: Translation | None = None) -> Any:
    """The validated RLConfig a command line runs, composed as `python -m mcore_rl.train <args>` composes it: verl's
    keys translated over verl's defaults; ours by Hydra over configs/<recipe>, or over the schema's defaults when the
    command names model.path without a recipe. `t`: the command's `resolve` when the caller already has it. Every
    problem raises one ConfigError (all of the command's, one per line). For callers that check a command without
    running it (launch/submit.py); train runs Hydra's own main with t.hydra_args for a command of ours."""
    from mcore_rl.config import ConfigError, register_schema, to_config

    t = t if t is not None else resolve(args)
    if t.errors:
        raise ConfigError("\n".join(t.errors))
    if t.verl:
        cfg = compose(t)
        if t.errors:
            raise ConfigError("\n".join(t.errors))
        return to_config(cfg)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    name, rest = split_config_name(t.hydra_args)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("mcore_rl.configs", version_base=None):
            dcfg = hydra_compose(config_name=name, overrides=rest)
    except Exception as err:  # noqa: BLE001 - Hydra's override and composition errors have several types
        raise ConfigError(str(err)) from None
    finally:
        GlobalHydra.instance().clear()
    return to_config(dcfg)


def config_of_verl_command(args: list[str]) -> Any:
    """The validated RLConfig of a verl command line, or None when the command is ours (compose_command composes
    both). Every problem of the command raises one ConfigError holding all of them, one per line."""
    t = resolve(args)
    if not t.verl and not t.errors:
        return None
    return compose_command(args, t)
