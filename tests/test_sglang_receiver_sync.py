"""Real actor ranks push weights into SGLang's own receiving code, and into our embedded server, byte for byte.

The trainer side is our sync pipeline on Megatron ranks (gloo), driven as the controller drives it (the test plays
the controller: it asks the stream leaders for rendezvous addresses, posts `/init_weights_update_group` with the body
controller/weight_sync.py sends, and has the leaders join). The receiving side is either
- tests/_sglang_receiver.py in a child process: SGLang 0.5.23's `init_custom_process_group`,
  `FlattenedTensorBucket` and `MultiprocessingSerializer` (with `monkey_patch_torch_reductions`), from the wheel; or
- our embedded server (mcore_rl/rollout/server.py),
and every tensor it received is compared, every byte, with the HF export of the same ranks.

Run: `.venv/bin/pytest tests/test_sglang_receiver_sync.py` (after `make setup`, which extracts SGLang's code).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed as dist
from _sglang_code import sglang_receiver_process
from safetensors.torch import load_file
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks

pytestmark = pytest.mark.slow

MOE = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=3)
#: a rendezvous that cannot meet fails in this time, not SGLang's 30 min; 30 s was too short for gloo ranks connecting
#: under CI load (two workers and a vLLM engine on 2 cores: "Gloo connectFullMesh ... Connect timeout")
TIMEOUT_S = 120


def _sync_rank(rank: int, world: int, urls: list[str], transport: str, layout: dict, version: int):
    """One sync of an actor with `layout` into the engines at `urls`; rank 0 returns the HF export of all ranks."""
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=MOE), ActorConfig(world_size=world, layout=LayoutConfig(**layout))
    )
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    actor.sync_plan(dict(num_engines=len(urls)), 1 << 14, "full")
    if transport == "distributed":
        # controller/weight_sync.py::connect: one group per stream, world 1 + engines x ranks, engine i at 1 + i;
        # group by group in the plan's stream order (the engines serve one init at a time, as SGLang's do)
        world_size = 1 + len(urls)
        summary, mine = actor.sync_summary(), actor.sync_addresses()
        for name, leader in zip(summary["stream_names"], summary["stream_leaders"]):
            if leader != rank:
                dist.barrier()  # the next group once this one has formed
                continue
            host, port = mine[name]
            calls = []
            for i, url in enumerate(urls):
                body = {"master_address": host, "master_port": port, "rank_offset": 1 + i, "world_size": world_size,
                        "group_name": name, "backend": "gloo", "timeout_s": TIMEOUT_S}  # fmt: skip
                calls.append(
                    threading.Thread(
                        target=requests.post,
                        args=(url + "/init_weights_update_group",),
                        kwargs={"json": body, "timeout": TIMEOUT_S + 10},
                    )
                )
                calls[-1].start()
            actor.sync_join(name, host, port, world_size, "gloo", TIMEOUT_S)
            for call in calls:
                call.join()
            dist.barrier()
    from mcore_rl.actor.sync_sender import PushRequest

    actor.sync_send(PushRequest(version, transport, urls, timeout_s=TIMEOUT_S))
    reference = {
        n: t.clone()
        for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    }
    parts = [None] * world
    dist.all_gather_object(parts, reference)
    return {k: v for p in parts for k, v in p.items()} if rank == 0 else None


class SGLangReceivers:
    """Engines that receive with SGLang's code, one child process each."""

    def __init__(self, count: int, tmp_path: Path) -> None:
        self._stack = contextlib.ExitStack()
        self.urls = [self._stack.enter_context(sglang_receiver_process()) for _ in range(count)]
        self._tmp = tmp_path

    def received(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        path = self._tmp / f"received-{i}.safetensors"
        answer = requests.post(self.urls[i] + "/dump_received", json={"path": str(path)}, timeout=60).json()
        return load_file(path), answer["arrivals"]

    def close(self) -> None:
        self._stack.close()


class EmbeddedServers:
    """Our embedded server (in-process threads); what it received is its model's HF state."""

    def __init__(self, count: int, tmp_path: Path) -> None:
        from mcore_rl.rollout.server import ServerThread, build_server

        self.threads = [ServerThread(build_server(dict(MOE), init_seed=99 + i)) for i in range(count)]
        self.urls = [t.url for t in self.threads]

    def received(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, int] | None]:
        return self.threads[i].server.engine.state_dict_hf(), None

    def close(self) -> None:
        for thread in self.threads:
            thread.stop()


@pytest.fixture(params=["sglang", "embedded"])
def engines(request, tmp_path):
    kind = SGLangReceivers if request.param == "sglang" else EmbeddedServers
    made: list = []

    def make(count: int):
        made.append(kind(count, tmp_path))
        return made[-1]

    yield make
    for engine_set in made:
        engine_set.close()


def _check(engine_set, count: int, reference: dict[str, torch.Tensor]) -> None:
    for i in range(count):
        got, arrivals = engine_set.received(i)
        if arrivals is not None:  # SGLang's receiver counts: every tensor of the export arrived exactly once
            assert arrivals == {name: 1 for name in reference}, f"engine {i}"
        missing = sorted(set(reference) - set(got))
        assert not missing, f"engine {i} never received {missing[:5]}"
        for name, tensor in reference.items():
            mine = got[name]
            assert mine.dtype == tensor.dtype and mine.shape == tensor.shape, (name, mine.dtype, tensor.dtype)
            assert torch.equal(mine.view(torch.uint8), tensor.contiguous().view(torch.uint8)), f"engine {i}: {name}"


LAYOUTS = [("ep2", dict(ep=2), 2), ("tp2", dict(tp=2, sequence_parallel=True), 2)]


# The embedded server's one-engine pushes are the long tier here: the CI tier's tests/test_sync_pipeline.py pushes
# into it through each transport and compares its logits with Megatron's, and the two-engine test below runs it.
@pytest.mark.parametrize("engines", ["sglang", pytest.param("embedded", marks=pytest.mark.long)], indirect=True)
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
@pytest.mark.parametrize("name, layout, world", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_every_byte_arrives(engines, transport, name, layout, world) -> None:
    """One engine: the rendezvous meets (distributed) or the payload opens (tensor), and every byte is the export's."""
    engine_set = engines(1)
    for url in engine_set.urls:
        assert requests.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
    reference = run_on_ranks(_sync_rank, world, (engine_set.urls, transport, layout, 3))[0]
    for url in engine_set.urls:
        assert requests.post(url + "/end_weight_update", json={}, timeout=30).status_code == 200
    _check(engine_set, 1, reference)


@pytest.mark.parametrize(
    "name, layout, world", [pytest.param("one-rank", {}, 1, id="1rank"), pytest.param("ep2", dict(ep=2), 2, id="ep2")]
)
def test_two_engines_join_at_their_rank_offsets(engines, name, layout, world) -> None:
    """Two engines in each group (ranks 1 and 2 of 3, as controller/weight_sync.py offsets them) both get every byte;
    with EP2 two leaders (rank 0 leading two streams) join their groups one after another and stream at once into
    engines that serve one control request at a time (SGLang's communicator and scheduler)."""
    engine_set = engines(2)
    for url in engine_set.urls:
        assert requests.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
    reference = run_on_ranks(_sync_rank, world, (engine_set.urls, "distributed", layout, 3))[0]
    for url in engine_set.urls:
        assert requests.post(url + "/end_weight_update", json={}, timeout=30).status_code == 200
    _check(engine_set, 2, reference)


def _sglang_nccl_rank(port: int, out) -> None:  # noqa: ANN001 (a spawn queue)
    """SGLang's side of an NCCL update group on cuda:1, as WeightUpdater.init_weights_update_group joins it."""
    import datetime

    from _sglang_code import load_sglang_receiver

    sglang = load_sglang_receiver()
    torch.cuda.set_device(1)
    dist.init_process_group("gloo", init_method=f"file:///tmp/sglang-default-group-{port}", rank=0, world_size=1)
    group = sglang.init_custom_process_group(
        backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name="pp0-dense",
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    tensor = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda:1")
    dist.broadcast(tensor, src=0, group=group)
    out.put(tensor.float().sum().item())


@pytest.mark.gpu
def test_nccl_rendezvous_meets_sglang_init_custom_process_group() -> None:
    """Our leader (cuda:0) and SGLang's function (cuda:1, another process) form one NCCL group and broadcast."""
    import multiprocessing

    from mcore_rl.parallel.groups import free_port
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks of one communicator on one GPU: needs 2 GPUs")
    port, context = free_port(), multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_sglang_nccl_rank, args=(port, out))
    child.start()
    try:
        torch.cuda.set_device(0)
        group = new_update_group("nccl", "127.0.0.1", port, 0, 2, "pp0-dense", TIMEOUT_S)
        broadcast(group, torch.ones(1 << 20, dtype=torch.bfloat16, device="cuda:0"))
        torch.cuda.synchronize()
        assert out.get(timeout=TIMEOUT_S) == float(1 << 20)
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
