"""No code shipped inside a checkpoint or tokenizer directory ever runs: every place that loads a tokenizer, config or
model with transformers passes trust_remote_code=False.

transformers, left at trust_remote_code=None, asks "Do you wish to run the custom code? [y/N]" on stdin for a
directory whose `auto_map` names classes it does not have, and runs the directory's Python file on "y". Each test
starts one loader of the project in a subprocess whose stdin answers "y" to every question, with a directory whose
`auto_map` module writes a marker file when imported: the marker must never appear (the load itself may fail: such
a directory cannot be used without its code).

Run: `.venv/bin/pytest tests/test_remote_code.py`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _evil_dir(root, marker) -> str:
    """A checkpoint + tokenizer directory whose config, model and tokenizer classes all live in its own evil.py."""
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    path = root / "evil"
    path.mkdir()
    build_tiny_tokenizer(str(path))
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    tok_cfg_path.write_text(json.dumps(tok_cfg))
    config = {
        "model_type": "evil",
        "architectures": ["EvilModel"],
        "auto_map": {
            "AutoConfig": "evil.EvilConfig",
            "AutoModelForCausalLM": "evil.EvilModel",
            "AutoModelForSequenceClassification": "evil.EvilModel",
        },
        "vocab_size": 64,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "num_labels": 1,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "evil.py").write_text(
        f"open({str(marker)!r}, 'a').write('ran\\n')\n"
        "from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return str(path)


LOADERS = {
    "preflight tokenizer check": """
        from mcore_rl.config import RLConfig
        from mcore_rl.config.model import ModelConfig
        from mcore_rl.preflight import check_tokenizer
        cfg = RLConfig(model=ModelConfig(path=PATH, tokenizer=PATH))
        check_tokenizer(cfg)
    """,
    "training start (the run's tokenizer)": """
        from mcore_rl.config import RLConfig
        from mcore_rl.config.model import ModelConfig
        from mcore_rl.train import setup_data
        cfg = RLConfig(model=ModelConfig(path=PATH, tokenizer=PATH))
        cfg.trainer.run_dir = RUN_DIR
        setup_data(cfg)
    """,
    "DPO start (the run's tokenizer)": """
        from mcore_rl.config import RLConfig
        from mcore_rl.config.model import ModelConfig
        from mcore_rl.controller.dpo_loop import setup_pairs
        cfg = RLConfig(model=ModelConfig(path=PATH, tokenizer=PATH))
        cfg.trainer.run_dir = RUN_DIR
        setup_pairs(cfg)
    """,
    "rollout engine start (model)": """
        from mcore_rl.rollout.engine import HFRolloutEngine
        HFRolloutEngine(PATH)
    """,
    "rollout server start (tokenizer)": """
        from mcore_rl.rollout.server import build_server
        build_server({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1}, tokenizer=PATH)
    """,
    "reward model worker": """
        from mcore_rl.reward.reward_model import RewardModelWorker
        RewardModelWorker(PATH, None)
    """,
}


@pytest.mark.parametrize("where", list(LOADERS))
def test_auto_map_code_never_runs(tmp_path, where: str) -> None:
    marker = tmp_path / "remote_code_ran"
    path = _evil_dir(tmp_path, marker)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = f"PATH, RUN_DIR = {path!r}, {str(run_dir)!r}\n" + textwrap.dedent(LOADERS[where])
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], input="y\n" * 20, capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert not marker.exists(), f"{where}: the directory's auto_map code ran\n{done.stdout}\n{done.stderr[-2000:]}"
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr, f"{where}: transformers asked"
