"""The command line: `python -m mcore_rl.train [--print-config] [--config-name NAME] overrides...`.

```
main(argv) -> resolve(argv): our keys or verl's (compat/verl/cli.py; the dry run makes the same decision)
   our keys  -> Hydra over configs/<name>.yaml -> to_config -> start
   verl keys -> compose_command (verl's defaults, translated) -> start
start(cfg) -> --print-config: the validated config, then stop | trainer.mode=dpo: run_dpo | else: train.run
             under lifecycle.run_guarded (exit codes, the FAILED marker, signals)
```
Every unknown or refused key of the command is reported at once (exit 2), before anything starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mcore_rl.config import RLConfig, register_schema, to_config

#: the RL loop (train.run), handed in by `python -m mcore_rl.train`, whose module this one does not import
RunLoop = Callable[[RLConfig], dict[str, float]]


def start(cfg: RLConfig, run: RunLoop, print_config: bool = False) -> None:
    """The RL loop `run`, or the DPO loop, under lifecycle's exit codes; with `print_config` the validated config in
    our keys instead."""
    from mcore_rl.lifecycle import run_guarded

    if print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        return
    if cfg.trainer.mode == "dpo":
        from mcore_rl.controller.dpo_loop import run_dpo

        run_guarded(cfg, run_dpo)
    else:
        run_guarded(cfg, run)


def main(run: RunLoop, argv: list[str] | None = None) -> None:
    """Parse the command (our keys over configs/default.yaml through Hydra, or verl's keys over verl's defaults),
    then `start` the run."""
    from mcore_rl.compat.verl.cli import SCHEMA_BASE_NOTE, compose_command, resolve

    argv = sys.argv[1:] if argv is None else argv
    print_config = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    t = resolve(args)
    for line in t.lines:
        print(f"verl: {line}")
    if not t.verl and not t.errors:
        if len(t.hydra_args) > len(args):  # base_of put the schema's defaults under it
            print(SCHEMA_BASE_NOTE)
        _run_hydra(t.hydra_args, run, print_config)
        return
    try:
        cfg = compose_command(args, t)
    except ValueError as err:  # ConfigError, and models' LayoutError from to_config
        for error in str(err).splitlines():
            print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)  # Hydra's job_logging=stdout
    start(cfg, run, print_config)


def _run_hydra(hydra_args: list[str], run: RunLoop, print_config: bool) -> None:
    """Hydra's own entry (its --config-name, overrides, logging set-up), which reads sys.argv: it gets the command
    without our flags. Unknown keys are refused by name first, and Hydra's composition errors exit 2
    (lifecycle.cli)."""
    import hydra
    from omegaconf import DictConfig

    from mcore_rl.lifecycle import cli

    register_schema()

    @hydra.main(config_path="pkg://mcore_rl.configs", config_name="default", version_base=None)
    def compose(dcfg: DictConfig) -> None:
        try:
            cfg = to_config(dcfg)
        except ValueError as err:
            print(f"config error: {err}", file=sys.stderr)
            sys.exit(2)
        start(cfg, run, print_config)

    sys.argv = [sys.argv[0], *hydra_args]
    cli(compose)
