"""SGLang launcher: the launch command checked against SGLang 0.5.23's own flag declarations, the actor's process
handling against real subprocesses (CPU), and one real SGLang server (`gpu`, where SGLang and CUDA exist).

SGLang 0.5.23 declares most flags as annotated fields in `sglang/srt/arg_groups/fields/*.py` (flag = `--` + the
field name with dashes, or `Arg(cli_name=...)`, plus `Arg(aliases=[...])`, none for `Arg(no_cli=True)`) and a few
with `parser.add_argument("--...")` in `server_args.py`; `make setup` extracts both under `.venv/sglang-0.5.23/`.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from mcore_rl.config import SGLangConfig
from mcore_rl.rollout.sglang_launcher import (
    _OWNED_FLAGS,
    FP8_QUANTIZATION_CONFIG,
    SGLangServerActor,
    build_launch_command,
    engine_model_dir,
    sglang_unavailable_reason,
)

SGLANG_SRC = Path(__file__).resolve().parents[1] / ".venv" / "sglang-0.5.23" / "sglang" / "srt"


def _launch(cfg: SGLangConfig, **overrides: object) -> list[str]:
    kwargs: dict = dict(model_path="/ckpt/hf", host="127.0.0.1", port=30000, api_key=None, dtype="bfloat16")
    kwargs.update(overrides)
    return build_launch_command(cfg, **kwargs)


def _flags(cmd: list[str]) -> dict[str, str | bool]:
    """`--flag value` pairs and bare `--flag`s (True) after the interpreter and entry point."""
    args = cmd[cmd.index("sglang.launch_server") + 1 :]
    out: dict[str, str | bool] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = True if nxt is None or nxt.startswith("--") else nxt
    return out


def _field_flags(source: str) -> set[str]:
    """The CLI flags SGLang registers from one arg_groups/fields/*.py file (its add_cli_args_from_dataclass rule)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        ann = node.annotation
        if not (isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple)):
            continue  # not A[T, ...]: no CLI flag
        default_flag = "--" + node.target.id.replace("_", "-")
        for meta in ann.slice.elts[1:]:
            if isinstance(meta, ast.JoinedStr) or (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                flags.add(default_flag)  # A[T, "help"]
                break
            if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    break
                flags.add(ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else default_flag)
                flags.update(ast.literal_eval(kw["aliases"]) if "aliases" in kw else [])
                break
    return flags


@pytest.fixture(scope="module")
def sglang_flags() -> set[str]:
    server_args = SGLANG_SRC / "server_args.py"
    fields_dir = SGLANG_SRC / "arg_groups" / "fields"
    if not server_args.is_file():
        pytest.fail(f"{server_args} is missing: run `make setup` (it extracts SGLang 0.5.23's server_args.py there)")
    if not any(fields_dir.glob("*.py")):
        pytest.fail(
            f"{fields_dir} is missing: run `make setup` (it must extract sglang/srt/arg_groups/fields/ from the "
            "SGLang 0.5.23 wheel beside server_args.py; most flags are declared there)"
        )
    flags = set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', server_args.read_text()))
    for path in fields_dir.glob("*.py"):
        flags |= _field_flags(path.read_text())
    # The reading of SGLang's declarations itself: one flag of each kind, and a no_cli field that has no flag.
    assert {"--enable-dp-attention", "--model-path", "--model", "--tp-size"} <= flags
    assert "--attn-cp-size" in flags and "--stat-loggers" not in flags
    return flags


def test_single_node_tp8_ep8_dp_attention_command() -> None:
    cfg = SGLangConfig(tp=8, ep=8, dp=8, enable_dp_attention=True, moe_a2a_backend="deepep", load_format="auto")
    cmd = _launch(cfg, max_running_requests=512, context_length=4096, python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert _flags(cmd) == {
        "--model-path": "/ckpt/hf",
        "--host": "127.0.0.1",
        "--port": "30000",
        "--dtype": "bfloat16",
        "--tp-size": "8",
        "--ep-size": "8",
        "--attn-dp-size": "8",  # SGLang 0.5.23's spelling of --dp-size 8 --enable-dp-attention
        "--moe-a2a-backend": "deepep",
        "--mem-fraction-static": "0.7",
        "--load-format": "auto",
        "--enable-memory-saver": True,
        "--skip-tokenizer-init": True,
        "--max-running-requests": "512",
        "--context-length": "4096",
    }


def test_two_node_engine_command() -> None:
    cfg = SGLangConfig(tp=16, ep=16, nnodes=2, enable_memory_saver=False, skip_tokenizer_init=False)
    flags = _flags(_launch(cfg, host="10.0.0.2", api_key="k", node_rank=1, dist_init_addr="10.0.0.1:5000"))
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1" and flags["--dist-init-addr"] == "10.0.0.1:5000"
    assert flags["--host"] == "10.0.0.2" and flags["--api-key"] == "k" and flags["--tp-size"] == "16"
    assert "--enable-memory-saver" not in flags and "--skip-tokenizer-init" not in flags
    # A one-node engine carries no multi-node flags, even when handed an address.
    assert "--nnodes" not in _flags(_launch(SGLangConfig(), dist_init_addr="10.0.0.1:5000"))


def test_dummy_load_format_and_float32() -> None:
    cmd = _launch(SGLangConfig(load_format="dummy"), dtype="float32")
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd[cmd.index("--dtype") + 1] == "float32"


def test_extra_args_come_last_as_given() -> None:
    extra = ["--cuda-graph-max-bs", "64", "--disable-radix-cache", "--log-level=warning"]
    assert _launch(SGLangConfig(extra_args=extra))[-4:] == extra


@pytest.mark.parametrize(
    ("cfg", "overrides", "named"),
    [
        (SGLangConfig(nnodes=2, tp=2), dict(host="10.0.0.2", api_key="k"), "dist_init_addr"),
        (SGLangConfig(extra_args=["--tp-size", "4"]), {}, "--tp-size"),
        (SGLangConfig(extra_args=["--tensor-parallel-size=4"]), {}, "--tensor-parallel-size"),
        (SGLangConfig(extra_args=["--dp-size", "2"]), {}, "--dp-size"),
        (SGLangConfig(extra_args=["--enable-dp-attention"]), {}, "--enable-dp-attention"),
        (SGLangConfig(), dict(host="0.0.0.0"), "api_key"),
        (SGLangConfig(), dict(host="10.0.0.2", api_key=""), "api_key"),
        (SGLangConfig(), dict(dtype="float16"), "dtype"),
        (SGLangConfig(nnodes=2, tp=2), dict(api_key="k", node_rank=2, dist_init_addr="h:1"), "node_rank"),
    ],
)
def test_refusals_name_the_argument(cfg: SGLangConfig, overrides: dict, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        _launch(cfg, **overrides)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_binds_need_no_key(host: str) -> None:
    assert _flags(_launch(SGLangConfig(), host=host))["--host"] == host


def test_every_emitted_flag_exists_in_sglang(sglang_flags: set[str]) -> None:
    configs = [
        SGLangConfig(tp=8, ep=8, dp=8, enable_dp_attention=True, moe_a2a_backend="deepep"),
        SGLangConfig(tp=16, ep=16, nnodes=2, load_format="auto"),
    ]
    emitted = set()
    for cfg in configs:
        cmd = _launch(
            cfg,
            host="10.0.0.2",
            api_key="k",
            max_running_requests=8,
            context_length=64,
            dist_init_addr="10.0.0.1:5000",
            return_routed_experts=True,
            fp8=True,
        )
        emitted |= {arg for arg in cmd if arg.startswith("--")}
    assert emitted - sglang_flags == set()
    # The flags (and SGLang aliases) extra_args may not repeat are SGLang's too, so the list cannot drift.
    assert (set(_OWNED_FLAGS) | set(_OWNED_FLAGS.values())) - sglang_flags == set()


def test_sglang_unavailable_reason_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("sglang") is not None and torch.cuda.is_available():
        pytest.skip("SGLang and CUDA are both here")
    # A bare directory named sglang on sys.path is not an install.
    (tmp_path / "sglang").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = sglang_unavailable_reason()
    assert isinstance(reason, str) and reason.endswith(".")
    assert "pip install -e '.[gpu]'" in reason and "rollout.engine=hf" in reason
    assert ("not installed" in reason) or ("CUDA" in reason)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting a reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_start_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    entry = ("-c", "import sys; print('boom', sys.argv[1:3]); sys.exit(3)")
    actor = SGLangServerActor(
        SGLangConfig(startup_timeout_s=60), "/ckpt/hf", "bfloat16", None, None, None, log_dir=str(tmp_path), entry=entry
    )
    with pytest.raises(RuntimeError, match="code 3") as err:
        actor.start()
    # The stand-in got our flags as its argv, and its output reached the error through the log file.
    assert "boom ['--model-path', '/ckpt/hf']" in str(err.value)
    assert Path(actor.log_path()).parent == tmp_path and "boom" in Path(actor.log_path()).read_text()


def test_start_times_out_and_stops_the_process(tmp_path: Path) -> None:
    entry = ("-c", "import time; print('loading', flush=True); time.sleep(120)")
    cfg = SGLangConfig(startup_timeout_s=1.5)
    actor = SGLangServerActor(cfg, "/ckpt/hf", "bfloat16", None, None, None, log_dir=str(tmp_path), entry=entry)
    with pytest.raises(TimeoutError, match="startup_timeout_s=1.5") as err:
        actor.start()
    assert "loading" in str(err.value)
    assert _wait_gone(actor.pid())


# A stand-in for the server's process tree, not for SGLang's API: it answers GET /health with 200 only after two 503s
# and only with the right bearer token, starts a child in its process group, and ignores SIGTERM (a hung server).
_STAND_IN = textwrap.dedent(
    """
    import argparse, http.server, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = argparse.ArgumentParser()
    p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--api-key")
    args, _ = p.parse_known_args()
    sleeper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", sleeper])
    print("child", child.pid, flush=True)
    calls = []
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            ok = self.path == "/health" and self.headers.get("Authorization") == f"Bearer {args.api_key}"
            self.send_response(200 if ok and len(calls) > 2 else 503 if ok else 401)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((args.host, args.port), H).serve_forever()
    """
)


def test_start_polls_health_and_stop_kills_the_process_group(tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    actor = SGLangServerActor(
        SGLangConfig(startup_timeout_s=60),
        "/ckpt/hf",
        "bfloat16",
        "secret",
        None,
        None,
        log_dir=str(tmp_path),
        entry=(str(script),),
    )
    url = actor.start()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    log = Path(actor.log_path()).read_text()
    child_pid = int(log.split("child ")[1].split()[0])
    leader_pid = actor.pid()
    assert _alive(leader_pid) and _alive(child_pid)
    t0 = time.monotonic()
    actor.stop(grace_s=1.0)
    assert time.monotonic() - t0 < 10
    assert _wait_gone(leader_pid) and _wait_gone(child_pid)
    actor.stop()  # a second stop is harmless


@pytest.mark.gpu
@pytest.mark.slow
def test_real_sglang_server_serves_health_and_generate(tmp_path: Path) -> None:
    reason = sglang_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 64: the smallest head size every SGLang CUDA attention backend supports.
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    cfg = SGLangConfig(load_format="auto", mem_fraction_static=0.3, enable_memory_saver=False, startup_timeout_s=600)
    actor = SGLangServerActor(
        cfg, str(tmp_path / "model"), "bfloat16", "test-key", 8, 512, log_dir=str(tmp_path / "logs")
    )
    try:
        url = actor.start()
        headers = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(urllib.request.Request(f"{url}/health", headers=headers), timeout=60) as response:
            assert response.status == 200
        body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(), headers=headers)
        with opener.open(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert isinstance(answer["output_ids"], list) and 1 <= len(answer["output_ids"]) <= 4, answer
    finally:
        actor.stop()
    assert _wait_gone(actor.pid())


def test_r3_asks_sglang_for_routed_experts() -> None:
    """Without --enable-return-routed-experts SGLang answers no routed_experts (R3 routing replay needs them)."""
    assert "--enable-return-routed-experts" in _launch(SGLangConfig(), return_routed_experts=True)
    assert "--enable-return-routed-experts" not in _launch(SGLangConfig())


def test_fp8_engine_declares_blockwise_fp8(tmp_path: Path) -> None:
    """sync.fp8 sends 128x128-blockwise e4m3 + weight_scale_inv: the engine must build FP8 parameters for them."""
    assert _flags(_launch(SGLangConfig(), fp8=True))["--quantization"] == "fp8"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2}))
    (ckpt / "tokenizer.json").write_text("{}")
    assert engine_model_dir(str(ckpt), str(tmp_path / "engine")) == str(ckpt), "nothing to change: used as it is"
    out = Path(engine_model_dir(str(ckpt), str(tmp_path / "engine"), fp8=True))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").resolve() == (ckpt / "tokenizer.json").resolve()
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text()), "the checkpoint is untouched"
    from_dict = Path(engine_model_dir({"model_type": "qwen3_moe"}, str(tmp_path / "d"), fp8=False))
    assert json.loads((from_dict / "config.json").read_text()) == {"model_type": "qwen3_moe"}


def test_engine_on_a_multi_node_cluster_binds_the_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a multi-node Ray cluster the router and the actor ranks may be elsewhere: loopback would reach their own
    node. The node's address needs the API key."""
    import mcore_rl.rollout.sglang_launcher as launcher

    monkeypatch.setattr(launcher, "_node_ip", lambda: "10.1.2.3")
    actor = SGLangServerActor(SGLangConfig(), "/ckpt/hf", "bfloat16", "key", None, None, bind_node_ip=True)
    assert actor.host == "10.1.2.3"
    assert SGLangServerActor(SGLangConfig(), "/ckpt/hf", "bfloat16", None, None, None).host == "127.0.0.1"
    with pytest.raises(ValueError, match="api_key is required"):
        SGLangServerActor(SGLangConfig(), "/ckpt/hf", "bfloat16", None, None, None, bind_node_ip=True)
