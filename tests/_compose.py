"""A command's config refusal checked in the test's own process.

`compose_command` is what `python -m mcore_rl.train <args>` runs before anything starts: the command's keys resolved
(ours or verl's), Hydra's composition over configs/<recipe>.yaml, and to_config's validation. A refusal there is the
CLI's `config error: ...` with exit 2 (tests/test_train_e2e.py runs that path as a process for one refusal of each
stage); checking the rest here saves a Python process with torch per case.
"""

from __future__ import annotations

import pytest


def assert_config_refused(args: list[str], message: str) -> None:
    """The command `args` is refused while it is composed, with `message` in the error."""
    from mcore_rl.compat.verl.cli import compose_command

    with pytest.raises(ValueError) as err:  # ConfigError, or the models' LayoutError from to_config
        compose_command(args)
    assert message in str(err.value), str(err.value)
