"""Shared pytest set-up: tests marked `gpu` skip where CUDA is absent; CPU tests never see a GPU; under pytest-xdist
(`make test` runs two workers) each file runs whole on one worker, and files that share machine-wide state run on the
same worker, one after the other."""

import json
import os

import pytest
import torch

# Keep every test process small on a 2-core machine (spawned ranks inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Files that touch the same machine-wide state; `--dist loadgroup` runs each group on one worker, in order
# (pytest_xdist_make_scheduler below).
SHARED_STATE = {
    # the namespace Slurm clusters of tools/slurm_local.sh (started, stopped and reconfigured by these tests); also
    # marked `serial`: `make test` runs them after the parallel pass, alone
    "slurm": ("test_submit_slurm.py", "test_submit_slurm2.py", "test_submit_slurm2_engines.py"),
    # the no-escape check lists every process of the sandbox's uid: another file's sandbox would count as escaped
    "sandbox": ("test_sandbox.py", "test_agent_loop.py"),
    # about 3 GB and both cores per vLLM engine: one engine at a time
    "vllm": (),  # every test_vllm_*.py (see _group)
}
_GROUP_OF = {name: group for group, names in SHARED_STATE.items() for name in names}
# Run alone after the parallel pass (marked `serial`): the Slurm jobs' time limits; bench_sync's quick run (four
# ranks, every transport: its shared-memory transport's manager timed out once with the other worker busy).
SERIAL = ("slurm", "test_bench_sync.py")


def _group(filename: str) -> str:
    if filename.startswith("test_vllm_"):
        return "vllm"
    return _GROUP_OF.get(filename, filename)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (absent where it is not installed)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup`: one work unit per group of `_group` (a file, or files sharing state), so a worker runs a
    group whole, in collection order, and a file's module fixtures (an engine, a vLLM server, a train run) start once.
    xdist's own loadgroup cannot be used: it tags `item._nodeid`, which pytest 9 no longer reads (it keeps `_id`), so
    every test became its own unit and the two workers each ran parts of every file, module fixtures included."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    return FileGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_of = {item: _group(item.path.name) for item in items}
    for item, group in group_of.items():
        if group in SERIAL:
            item.add_marker(pytest.mark.serial)
    # The longest groups first (xdist hands out groups in this order, `--no-loadscope-reorder`), so that neither
    # worker starts one at the end: vLLM's, then by the number of slow tests (end-to-end runs, gloo ranks).
    weight: dict[str, int] = {}
    for item, group in group_of.items():
        weight[group] = weight.get(group, 0) + ("slow" in item.keywords)
    weight["vllm"] = 1 << 20
    items.sort(key=lambda item: -weight[group_of[item]])
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: this machine has no usable GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def vllm_venv():
    """The vLLM tier's virtualenv (every test that needs vLLM asks for this): `make vllm-setup` once per session (a
    no-op when its stamp is fresh), then the launcher's own check; skip, with the reason, where vLLM cannot be
    installed. Returns the VLLMConfig the tests start engines with."""
    import subprocess

    from mcore_rl.rollout.vllm_config import VLLMConfig
    from mcore_rl.rollout.vllm_launcher import vllm_unavailable_reason

    cfg = VLLMConfig(startup_timeout_s=600)
    if vllm_unavailable_reason(cfg) is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        done = subprocess.run(["make", "vllm-setup"], cwd=root, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            pytest.skip(f"vLLM cannot be installed here (make vllm-setup failed): {done.stderr.strip()[-800:]}")
    reason = vllm_unavailable_reason(cfg)
    if reason is not None:
        pytest.skip(reason)
    return cfg


@pytest.fixture
def model_dir(tmp_path):
    """A dense Qwen2 checkpoint directory (config.json only: the config check reads nothing else), for the verl
    translation tests (test_verl_config.py, test_verl_offload_overlap.py)."""
    path = tmp_path / "qwen2"
    path.mkdir()
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
