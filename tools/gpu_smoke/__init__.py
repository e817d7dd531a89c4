"""The GPU check kit: every CUDA path one GPU can run, in under 8 minutes, with only torch, triton and CUDA installed.

    python -m tools.gpu_smoke --out /tmp/gpu_smoke          # on a GPU box (see docs/gpu.md)
    python -m tools.gpu_smoke --dry-cpu --out /tmp/smoke    # its CPU parts (CI: tests/test_gpu_smoke.py)

run.py runs each step in its own process with its own timeout; every step writes its results as it goes, so a
cut-off run still reports. Steps: env (versions, carried wheels), gpu_tests (the project's `gpu` tests), kernels
(Triton block copy and FP8 at the 128x128 tile), actor_qwen3_moe / actor_dsv3 (a Megatron actor on CUDA), sglang_ipc
and sglang_nccl (the SGLang boundary with SGLang's own receiving code).
"""
