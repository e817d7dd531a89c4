"""`tools/bench_sync.py --connect`: how long `WeightSync.connect` takes for streams x engines (SGLang-code engines).

Per shape SxE: S streams, stream i led by actor rank i % 2 (as in EP layouts, where a rank leads a dense and an
expert stream), E engines of one rank each that queue control requests as SGLang 0.5.23 does
(tests/_sglang_receiver.py: its FanOutCommunicator and init_custom_process_group), gloo groups. The controller is the
project's `WeightSync.connect`, the leaders Ray actors running the project's `SyncSender` (tests/_connect_cluster.py).
Each repeat is one `connect` of all engines (the engines leave the previous groups first, as on an engine
replacement). Printed per shape: the median and the spread of the repeats, then one line

    connect: streams=<S> engines=<E> seconds=<median>
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any


def run_connect(shapes: list[tuple[int, int]], repeats: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Time `repeats` connects per (streams, engines) shape; the rows printed by `report_connect`."""
    import ray
    from _connect_cluster import Leader, lead, weight_sync
    from _sglang_code import sglang_receiver_process

    from mcore_rl.rollout.client import RolloutClient

    rows = []
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    client = RolloutClient("http://127.0.0.1:9", engine="sglang")
    try:
        leaders = [Leader.remote(rank) for rank in range(2)]
        most = max(engines for _, engines in shapes)
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(sglang_receiver_process()) for _ in range(most)]
            for streams, engines in shapes:
                names = [f"c{streams}x{engines}-s{i}" for i in range(streams)]
                lead(leaders, {name: i % 2 for i, name in enumerate(names)})
                sync = weight_sync(leaders, client, "gloo", names, timeout_s)
                seconds = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    sync.connect(urls[:engines])
                    seconds.append(time.perf_counter() - start)
                rows.append({"streams": streams, "engines": engines, "seconds": seconds})
    finally:
        client.close()
        ray.shutdown()
    return rows


def report_connect(rows: list[dict[str, Any]]) -> None:
    """Print each shape's median connect time (and the repeats), then one summary line per shape."""
    for row in rows:
        spread = ", ".join(f"{s:.3f}" for s in row["seconds"])
        print(f"connect {row['streams']}x{row['engines']}: median {statistics.median(row['seconds']):.3f} s ({spread})")
    for row in rows:
        median = statistics.median(row["seconds"])
        print(f"connect: streams={row['streams']} engines={row['engines']} seconds={median:.4g}", flush=True)
