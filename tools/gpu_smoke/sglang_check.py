"""Kit steps `sglang_ipc` and `sglang_nccl`: the SGLang boundary, driven with SGLang 0.5.23's own receiving code (the
module `make setup` extracts from the pinned wheel: .venv/sglang-0.5.23/sglang_cpu_receiver.py, loaded as
tests/_sglang_code.py does; carry that folder to the GPU box) in a second process, as an engine rank would.

    ipc    our tensor transport's payload (a flattened bucket: CUDA IPC handles with the GPU's UUID, as SGLang's senders
           write them) -> SGLang's MultiprocessingSerializer.deserialize (its SafeUnpickler) after its
           monkey_patch_torch_reductions -> FlattenedTensorBucket.reconstruct_tensors: every tensor equal
    nccl   our update group (parallel/update_group.py, rank 0) and SGLang's init_custom_process_group (rank 1) meet
           in one NCCL group and a bucket is broadcast. One GPU: NCCL refuses two ranks on one device ("Duplicate
           GPU"), so there the rendezvous is checked and the broadcast needs a second GPU (said in the result)

--dry-cpu: the same with shared-memory CPU tensors and gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]

#: the child: an "engine rank" using only SGLang's code (and torch) to receive
_IPC_CHILD = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("sglang_cpu_receiver", sys.argv[1])
sgl = importlib.util.module_from_spec(spec); sys.modules["sglang_cpu_receiver"] = sgl; spec.loader.exec_module(sgl)
sgl.monkey_patch_torch_reductions()
payload = sys.stdin.read()
obj = sgl.MultiprocessingSerializer.deserialize(payload)
bucket = sgl.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
out = {name: [str(t.device), float(t.double().sum()), list(t.shape)] for name, t in bucket.reconstruct_tensors()}
if torch.cuda.is_available():
    torch.cuda.synchronize()
print(json.dumps(out))
"""

_NCCL_CHILD = r"""
import datetime, importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("sglang_cpu_receiver", sys.argv[1])
sgl = importlib.util.module_from_spec(spec); sys.modules["sglang_cpu_receiver"] = sgl; spec.loader.exec_module(sgl)
backend, port, device, broadcast = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
if backend == "nccl":
    torch.cuda.set_device(int(device))
group = sgl.init_custom_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                      group_name="gpu_smoke", timeout=datetime.timedelta(seconds=60))
out = {"joined": True}
if broadcast:
    t = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda" if backend == "nccl" else "cpu")
    torch.distributed.broadcast(t, src=0, group=group)
    out["checksum"] = float(t.double().sum())
print(json.dumps(out))
"""


def _receiver() -> Path | None:
    sys.path.insert(0, str(REPO / "tests"))
    from _sglang_code import RECEIVER_PATH

    return RECEIVER_PATH if RECEIVER_PATH.is_file() else None


def ipc(rec: Any, dry: bool) -> None:
    """Our payload through SGLang's deserializer in a second process (see the module docstring)."""
    from mcore_rl.resharding.sync.wire import encode, encode_cuda, flatten

    path = _receiver()
    if path is None:
        return rec.skip("SGLang's extracted receiver is missing (make setup builds .venv/sglang-0.5.23; carry it)")
    device = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    named = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 128, dtype=torch.bfloat16, device=device)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(64, 96, dtype=torch.float32, device=device)),
        ("model.norm.weight", torch.randn(128, dtype=torch.bfloat16, device=device)),
    ]
    flat, metadata = flatten(named)
    payload = (encode if dry else encode_cuda)({"flattened_tensor": flat, "metadata": metadata})
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _IPC_CHILD, str(path)], input=str(payload), capture_output=True,
                         text=True, timeout=25)  # fmt: skip
    rec["seconds"] = round(time.perf_counter() - start, 3)
    if res.returncode != 0:
        raise RuntimeError(f"SGLang's side failed: {res.stderr[-2000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = {name: float(t.double().sum()) for name, t in named}
    equal = set(got) == set(want) and all(got[n][1] == want[n] for n in want)
    rec["received"] = got
    rec["devices"] = sorted({v[0] for v in got.values()})
    rec["equal"] = equal
    rec["summary"] = f"{len(got)} tensors through SGLang's deserializer on {rec['devices']}: equal={equal}"
    if not equal:
        rec["status"] = "failed"


def nccl(rec: Any, dry: bool) -> None:
    """Our update group and SGLang's init_custom_process_group in one group (see the module docstring)."""
    from mcore_rl.parallel.groups import free_port
    from mcore_rl.parallel.update_group import broadcast as update_broadcast
    from mcore_rl.parallel.update_group import new_update_group

    path = _receiver()
    if path is None:
        return rec.skip("SGLang's extracted receiver is missing (make setup builds .venv/sglang-0.5.23; carry it)")
    backend = "gloo" if dry else "nccl"
    two_gpus = not dry and torch.cuda.device_count() >= 2
    broadcast = dry or two_gpus
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-c", _NCCL_CHILD, str(path), backend, str(port), "1" if two_gpus else "0",
         "1" if broadcast else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if backend == "nccl":
            torch.cuda.set_device(0)
        group = new_update_group(backend, "127.0.0.1", port, rank=0, world_size=2, group_name="gpu_smoke", timeout_s=60)
        rec["rendezvous"] = "ok"
        if broadcast:
            t = torch.randn(1 << 20, dtype=torch.bfloat16, device="cuda" if backend == "nccl" else "cpu")
            start = time.perf_counter()
            update_broadcast(group, t, src=0)
            rec["broadcast_s"] = round(time.perf_counter() - start, 4)
        out, err = child.communicate(timeout=25)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0:
        raise RuntimeError(f"SGLang's side failed: {err[-2000:]}")
    got = json.loads(out.strip().splitlines()[-1])
    rec["sglang_side"] = got
    if broadcast:
        rec["equal"] = got["checksum"] == float(t.double().sum())
        rec["summary"] = f"{backend} group with SGLang's init_custom_process_group: broadcast equal={rec['equal']}"
        if not rec["equal"]:
            rec["status"] = "failed"
    else:
        rec["summary"] = (
            "NCCL rendezvous with SGLang's init_custom_process_group ok; broadcast needs a second GPU (NCCL refuses "
            "two ranks on one device)"
        )
