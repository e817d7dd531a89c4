"""Package metadata for mcore_rl.

`parallel/`, `resharding/` and `kernels/` live at the top of the repository but install inside the `mcore_rl`
namespace (`mcore_rl.parallel`, ...), so that we never install a generic top-level name such as `kernels`
(another PyPI project owns it). Tool settings (ruff, pytest) live in pyproject.toml.
"""

from setuptools import find_packages, setup

# Folders at the repository root that import as mcore_rl.<name>.
_MAPPED = ("parallel", "resharding", "kernels")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages = find_packages(include=["mcore_rl", "mcore_rl.*"])
    package_dir = {"mcore_rl": "mcore_rl"}
    for folder in _MAPPED:
        for sub in [""] + ["." + p for p in find_packages(where=folder)]:
            packages.append(f"mcore_rl.{folder}{sub}")
        package_dir[f"mcore_rl.{folder}"] = folder
    # Hydra YAML ships inside the package too (Hydra reads it as pkg://mcore_rl.configs).
    packages.append("mcore_rl.configs")
    package_dir["mcore_rl.configs"] = "configs"
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="mcore_rl",
    version="0.1.0",
    description="Megatron-first RL post-training for large Mixture-of-Experts LLMs",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"mcore_rl.configs": ["*.yaml", "**/*.yaml"]},
    install_requires=[
        # torch is pinned by the Makefile (a CPU build here, a CUDA build on clusters); any 2.x works.
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "ray[default]>=2.40",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "safetensors>=0.4",
        "pyarrow>=15",
        "nvidia-ml-py>=12",
        "transformers>=4.51",
        "tqdm>=4.66",
        # megatron-core's torch_dist writer imports psutil in its worker processes; without it a save hangs.
        "psutil>=5.9",
        "numpy",
        # The default job runs sglang-router (a Rust binary, CPU is fine) in front of our embedded aiohttp server.
        "sglang-router>=0.3.2,<0.4",
        "aiohttp>=3.9",
        # trainer.loggers=[...,tensorboard] writes event files through torch.utils.tensorboard; the package is light
        # (no torch or CUDA of its own: absl-py, grpcio, markdown, protobuf, werkzeug, tensorboard-data-server).
        "tensorboard>=2.14",
    ],
    extras_require={
        # GPU extras. NVIDIA apex is built from source (see README); the PyPI project named `apex` is unrelated.
        # The tested set is constraints-gpu.txt (pip install -c constraints-gpu.txt -e '.[gpu]'): SGLang 0.5.23 pins
        # torch, transformers and tokenizers exactly; megatron-core 0.16.1 bounds Transformer Engine to <2.12.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "sglang==0.5.23"],
        # pytest-xdist: `make test` runs the suite on two workers (tests/conftest.py keeps files, shared state whole).
        # msgspec: SGLang's api_types.py (fetched by `make setup`, see tools/fetch_sglang_contract.py) needs it.
        # triton: tests run the Triton kernels on CPU under TRITON_INTERPRET=1. It depends on nothing (torch stays as
        # the Makefile pinned it); a CUDA torch already pins its own triton, which satisfies this. Wheels: Linux only.
        # gguf, accelerate: `make real-model` (tools/make_real_model.py) dequantises SmolLM2-135M-Instruct's GGUF
        # with transformers' GGUF loader, which needs both; the test suite makes that model (tests/test_real_model.py).
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",
            "ruff>=0.6",
            "msgspec",
            "triton; platform_system == 'Linux'",
            "gguf>=0.17",
            "accelerate>=1.0",
        ],  # fmt: skip
        # trainer.loggers=[...,wandb]: Weights & Biases (offline by default; imported only when asked for).
        "wandb": ["wandb>=0.17"],
    },
)
