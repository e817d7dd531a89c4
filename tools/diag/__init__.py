"""Helpers for `tools/nccl_diag.py`, the NCCL/GDR doctor (see that script for usage).

    env_probe.py    GPUs (nvidia-ml-py), NVLink, IB ports (sysfs), GPUDirect RDMA module
    env_rules.py    NCCL_* / GLOO_* variables and the risky values among them
    nccl_log.py     NCCL_DEBUG=INFO log parser -> transports, network, NVLS, diagnosis
    sweep.py        collective bandwidth sweep (torchrun, local spawn, or Ray one-per-node)
    expectations.py reference busbw per link kind and the sweep verdict

Nothing here imports torch at module level except sweep.py, so `env` and `log` start fast.
"""
