"""What Ray's memory monitor killed, read from the raylet's log: the cause of a run's failure that Ray itself reports
only there (an engine or a rank "failed its /health probes", "died"). lifecycle.py and the run session
(controller/session.py) name it in their one line."""

from __future__ import annotations

import os
import re
import time

_KILL_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ .*Killing \d+ worker\(s\), kill details: Memory on the node "
    r"\(IP: [^,]*, ID: \w+\) was ([\d.]+)GB used / ([\d.]+)GB limit"
)
_SELECTED = re.compile(r"task name=([^,]*), .*?pid=(\d+), actual memory used=([\d.]+)GB")


def oom_kills(raylet_log: str, since: float = 0.0) -> list[str]:
    """One line per worker Ray's memory monitor killed, read from a raylet.out (its OOM report spans several lines:
    the kill line with the node's memory, then "Selected to kill: (... task name=..., pid=..., actual memory used=...)",
    ray 2.60); kills logged before `since` (a time.time(), the log's local time) are left out."""
    found = []
    lines = raylet_log.splitlines()
    for at, line in enumerate(lines):
        kill = _KILL_LINE.match(line)
        if kill is None or time.mktime(time.strptime(kill.group(1), "%Y-%m-%d %H:%M:%S")) < int(since):
            continue
        for follow in lines[at + 1 : at + 200]:
            if follow.startswith("["):  # the next log record: this report is over
                break
            for task, pid, used in _SELECTED.findall(follow):
                named, _, method = task.rpartition(":")  # "engine-0:Engine.__init__", or "MegatronActor.call_packed"
                name = f"{named} ({method.split('.')[0]})" if named else method.split(".")[0]
                found.append(
                    f"Ray's memory monitor killed {name}, pid {pid}, using {used} GB, when the node's memory was at "
                    f"{kill.group(2)} GB of {kill.group(3)} GB (above Ray's kill threshold, RAY_memory_usage_threshold)"
                )
    return found


def ray_oom_kills(since: float) -> list[str]:
    """oom_kills of this driver's Ray session since `since`, a time.time() (empty without a local raylet log or
    Ray)."""
    try:
        import ray

        node = ray._private.worker._global_node
        if node is None:
            return []
        path = os.path.join(node.get_session_dir_path(), "logs", "raylet.out")
        with open(path, errors="replace") as f:
            return oom_kills(f.read(), since=since)
    except (ImportError, AttributeError, OSError):
        return []


def oom_message(kills: list[str]) -> str:
    """The one line for a run that failed after Ray's memory monitor killed its processes."""
    return (
        f"{'; '.join(kills)}: the run cannot go on without it. Give the run more memory (fewer runs on this machine), "
        f"or make it smaller: rollout.max_running_requests, actor.micro_batch_size, data.max_prompt_length, "
        f"rollout.max_new_tokens"
    )
