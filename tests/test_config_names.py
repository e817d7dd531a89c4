"""The torch-free names that config validation checks against (mcore_rl/config/names.py) are the registries' keys."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from mcore_rl.config import names


@pytest.mark.parametrize("name", sorted(names.MIRRORS))
def test_each_name_tuple_equals_its_registry(name: str) -> None:
    module, registry = names.MIRRORS[name]
    keys = tuple(getattr(importlib.import_module(module), registry))
    assert getattr(names, name) == keys, f"mcore_rl/config/names.py: {name} must list {module}.{registry}: {keys}"


def test_every_tuple_is_mirrored() -> None:
    tuples = {k for k, v in vars(names).items() if k.isupper() and isinstance(v, tuple)}
    assert tuples == set(names.MIRRORS)


def test_a_misspelt_name_is_refused_without_importing_torch() -> None:
    """The group checks that use these names run before the model-family checks (which need torch): a misspelt
    estimator, loss, KL setting, replay mode or transport is refused in well under a second. (DPO's settings are
    checked after the model, in DPO mode only.)"""
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_module\n"
        "from mcore_rl.config import ConfigError, register_schema, to_config\n"
        "register_schema()\n"
        "keys = [('default', k) for k in ('algorithm.adv_estimator', 'actor.policy_loss', 'actor.loss_agg_mode',\n"
        "        'algorithm.kl_ctrl.type', 'actor.router_replay_mode', 'sync.transport', 'sync.mode')]\n"
        "with initialize_config_module('mcore_rl.configs', version_base=None):\n"
        "    for config, key in keys:\n"
        "        try:\n"
        "            to_config(compose(config_name=config, overrides=[key + '=bogus']))\n"
        "        except ConfigError as err:\n"
        "            assert key in str(err), (key, str(err))\n"
        "        else:\n"
        "            raise AssertionError(key + '=bogus was accepted')\n"
        "print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
