"""sglang-router in front of the rollout engines: start it on loopback, add and remove workers, stop it.

    router = Router(["http://127.0.0.1:31001", "http://127.0.0.1:31002"], policy="cache_aware", api_key=key)
    url = router.start()                  # http://127.0.0.1:<port>; /generate goes here
    router.remove_worker(dead_url); ...; router.add_worker(restarted_url)
    router.stop()

With `api_key` the router sends it to the workers and asks it of its own clients (`Authorization: Bearer`).
The router (PyPI `sglang-router`, a Rust binary; 0.3.x API) probes each worker's /health, /server_info and
/model_info when it is added, and proxies /generate (retrying on another worker when one fails). Weight updates,
pause and continue are not proxied: the controller sends those to every engine directly. Workers are added with
`POST /workers {"url"}` (answered 202, registered in the background, so `add_worker` polls `GET /workers` until
the worker is listed healthy) and removed with `DELETE /workers/{id}`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from mcore_rl.parallel.groups import free_port

#: sglang_router.launch_router --policy choices this project uses (rollout.router_policy is checked against them)
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def _http(
    method: str, url: str, body: Any = None, timeout: float = 10.0, api_key: str | None = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


_KEY_ENV = "MCORE_RL_ROUTER_API_KEY"
# sglang-router takes its key only as --api-key (no environment variable or file): this runs launch_router in the
# same interpreter with the key appended to sys.argv, which the kernel's copy of the command line never sees. The
# Rust router runs inside this process (a Python extension), so no further exec puts the key back on a command line.
_LAUNCH = (
    "import os, sys\n"
    f"key = os.environ.pop({_KEY_ENV!r}, None)\n"
    "sys.argv = ['sglang_router.launch_router', *sys.argv[1:], *(['--api-key', key] if key else [])]\n"
    "from sglang_router.launch_router import main\n"
    "main()\n"
)


#: the route the router's periodic probe asks each worker (see `Router.command`)
HEALTH_CHECK_ENDPOINT = "/model_info"


class Router:
    """One sglang-router process on loopback (see the module docstring)."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        policy: str = "cache_aware",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_dir: str | None = None,
        request_timeout_s: float = 600.0,
        health_check_interval_s: int = 30,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} is invalid: expected one of {POLICIES}")
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.api_key = api_key
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        # Without one, a temporary directory that start() creates and stop() removes unless the router logged there.
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or os.path.join(tempfile.gettempdir(), f"mcore_rl_router_{uuid.uuid4().hex[:12]}")
        self.log_path = os.path.join(self.log_dir, f"router-{self.port}.log")
        self.request_timeout_s = request_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self._proc: subprocess.Popen | None = None
        self.restarts = 0  #: times `restart` launched it again

    def command(self) -> list[str]:
        """The launch_router command line. The API key is not on it (/proc/<pid>/cmdline is readable by every local
        user): `_LAUNCH` takes it from the environment (`env()`), which only the same user can read."""
        cmd = [
            sys.executable, "-c", _LAUNCH,
            "--host", self.host, "--port", str(self.port), "--policy", self.policy,
            # whole seconds, rounded up: int() truncated rollout.request_timeout_s=0.001 to 0
            "--request-timeout-secs", str(max(1, math.ceil(self.request_timeout_s))),
            # A dead engine's requests are retried on the others; the controller, not the router's periodic probe,
            # decides when an engine is dead and removes it, so the probe only needs to be slow and cheap. It asks
            # /model_info (the HTTP process answers; no forward): SGLang's /health generates a token, so it fails
            # (and after 3 failures the router stops routing to the engine, and wants 2 successes back) whenever
            # the engine is paused for longer than its health-check timeout, which a colocated engine is for every
            # training phase. A dead process still fails it.
            "--retry-max-retries", "3", "--health-check-interval-secs", str(self.health_check_interval_s),
            "--health-check-endpoint", HEALTH_CHECK_ENDPOINT, "--log-level", "warn",
            "--log-dir", self.log_dir,
            # its Prometheus exporter binds 29000 by default: two routers on one machine would collide
            "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
        ]  # fmt: skip
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        return cmd

    def env(self) -> dict[str, str]:
        """The router's environment: ours, plus the API key for `_LAUNCH` to move onto launch_router's arguments."""
        env = {k: v for k, v in os.environ.items() if k != _KEY_ENV}
        if self.api_key:
            env[_KEY_ENV] = self.api_key
        return env

    def start(self, timeout_s: float = 120.0) -> str:
        """Launch the router and wait until it answers /health with every initial worker registered; its URL."""
        os.makedirs(self.log_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env()
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self._proc.returncode}:\n{self._log_tail()}")
            try:
                if _http("GET", self.url + "/health", timeout=2, api_key=self.api_key)[0] == 200 and self._registered(
                    self.worker_urls
                ):
                    return self.url
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"sglang-router did not come up within {timeout_s:.0f} s:\n{self._log_tail()}")

    def restart(self, worker_urls: list[str], timeout_s: float = 120.0) -> str:
        """Launch the router again at the same address, so its clients keep their URL, with `worker_urls` (the
        engines that are live now; those restarting join later through add_worker). The process that died is reaped
        first, and one that lingers is killed. The router keeps no state a run needs beyond its worker list: its
        cache-aware policy's prefix trees fill again from the next requests."""
        self._terminate()
        self.worker_urls = list(worker_urls)
        self.restarts += 1
        return self.start(timeout_s)

    def workers(self) -> list[dict[str, Any]]:
        """The router's worker list (`GET /workers`): dicts with id, url, is_healthy, load, ..."""
        status, body = _http("GET", self.url + "/workers", api_key=self.api_key)
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"sglang-router GET /workers answered {status}: {body}")
        return body.get("workers", [])

    def _registered(self, urls: list[str]) -> bool:
        listed = {w.get("url"): w for w in self.workers()}
        return all(u in listed and listed[u].get("is_healthy", True) for u in urls)

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register `url` and wait until the router lists it healthy (the router answers 202 and probes it)."""
        body: dict[str, Any] = {"url": url, "worker_type": "regular"}
        if self.api_key:
            body["api_key"] = self.api_key
        status, answer = _http("POST", self.url + "/workers", body, api_key=self.api_key)
        if status not in (200, 201, 202):
            raise RuntimeError(f"sglang-router refused worker {url}: {status} {answer}")
        deadline = time.monotonic() + timeout_s
        while not self._registered([url]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router did not register worker {url} within {timeout_s:.0f} s")
            time.sleep(0.1)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister `url` (a no-op when it is not listed) and wait until it is gone from the list."""
        for worker in self.workers():
            if worker.get("url") == url:
                _http("DELETE", f"{self.url}/workers/{worker['id']}", api_key=self.api_key)
        deadline = time.monotonic() + timeout_s
        while any(w.get("url") == url for w in self.workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router still lists worker {url} after {timeout_s:.0f} s")
            time.sleep(0.1)

    def died(self) -> str | None:
        """How the router process ended, if it has (None while it runs, or before start): one line for the user."""
        if self._proc is None or self._proc.poll() is None:
            return None
        code = self._proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"the router (sglang-router, pid {self._proc.pid}) died ({how}); its log: {self.log_path}"

    def _log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Terminate the router (its whole process group), then kill it if it lingers; a temporary log directory goes
        with it unless the router wrote something there."""
        try:
            self._terminate()
        finally:
            if self._own_log_dir and not any(os.path.getsize(p) for p in _files(self.log_dir)):
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def _terminate(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def _files(directory: str) -> list[str]:
    """Every file under `directory` (none when it is gone)."""
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]
