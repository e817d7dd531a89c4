"""The multi-turn agent loop (mcore_rl/rollout/agent/): loss masks, turn and token limits, bad tool calls, concurrency.

The loop's only dependency on the model is the rollout client's `agenerate_one`; here a scripted policy answers it
(what a trained model would say, so tool calls actually happen), and one test drives a real embedded server.
Run: `.venv/bin/pytest tests/test_agent_loop.py`
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mcore_rl.actor.batch import micro_batches, sequence_length
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.rollout.agent.loop import AgentLoop, AgentSettings, episode_metrics
from mcore_rl.rollout.agent.parser import CallError, ToolCall, get_chat_format
from mcore_rl.rollout.agent.tools import Tool, ToolSet, evaluate_arithmetic, get_tool, register_tool
from mcore_rl.rollout.sampling import Sample

TOK = build_tiny_tokenizer(None, tools=True)
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": 7}}</tool_call>'
LOOKUP = {"tools_kwargs": {"lookup": {"create_kwargs": {"key": 7, "value": "3"}}}}


class ScriptedPolicy:
    """Answers each turn with the next text of a script (+ eos), with made-up logprobs and the engine's version."""

    def __init__(self, turns: list[str], version: int = 5, pause: float = 0.0) -> None:
        self.turns, self.version, self.pause = turns, version, pause
        self.contexts: list[list[int]] = []
        self.in_flight = self.max_in_flight = 0

    async def agenerate_one(self, prompt, n, params, *, seed=None):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.pause)
        self.in_flight -= 1
        self.contexts.append(list(prompt))  # one episode per policy, except in the concurrency test (one turn)
        text = self.turns[min(len(self.contexts) - 1, len(self.turns) - 1)]
        ids = TOK.encode(text, add_special_tokens=False)[: params["max_new_tokens"]]
        stopped = len(ids) < params["max_new_tokens"]
        ids = ids + [EOS] if stopped else ids
        return [
            Sample(list(prompt), ids, [-0.5] * len(ids), "stop" if stopped else "length", self.version,
                   [(self.version, 0, len(ids))])
        ]  # fmt: skip


def run(policy, tools=None, prompt=(1, 2, 3), max_turns=3, budget=512, per_turn=128, timeout=1.0, max_errors=None):
    settings = AgentSettings(max_turns, budget, per_turn, timeout, max_errors)
    loop = AgentLoop(policy, TOK, get_chat_format("hermes"), settings, {"stop_token_ids": [EOS]})
    toolset = ToolSet.for_sample(["calculator"], LOOKUP if tools is None else tools)
    return asyncio.run(loop.run_episode(list(prompt), toolset, seed=0))


def test_tool_call_episode_masks_tool_tokens_and_keeps_model_logprobs():
    episode = run(ScriptedPolicy([CALL, "3"]))
    s = episode.sample
    assert episode.finish == "answer" and len(episode.turns) == 2 and not episode.errors
    call_ids = TOK.encode(CALL, add_special_tokens=False) + [EOS]
    tool_text = get_chat_format("hermes").tool_responses(["3"], turn_ended=True)
    tool_ids = TOK.encode(tool_text, add_special_tokens=False)
    answer_ids = TOK.encode("3", add_special_tokens=False) + [EOS]
    assert s.response_ids == call_ids + tool_ids + answer_ids
    assert s.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
    assert all((lp == 0.0) == (m == 0) for lp, m in zip(s.response_logprobs, s.loss_mask))
    assert "<tool_response>\n3\n</tool_response>" in TOK.decode(s.response_ids)
    # per-turn records and version spans point at the model's tokens only
    second = episode.turns[1]
    assert (second.start, second.end) == (len(call_ids) + len(tool_ids), len(s.response_ids))
    assert [(a, b) for _, a, b in s.weight_versions] == [(0, len(call_ids)), (second.start, second.end)]


def test_mask_holes_reach_the_trainer_batch():
    episodes = [run(ScriptedPolicy([CALL, "3"])), run(ScriptedPolicy(["9"]))]
    batch, _ = samples_to_batch([e.sample for e in episodes], n=2)
    assert batch.lengths.tolist() == [len(e.sample.response_ids) for e in episodes]
    assert batch.response_mask[0].tolist()[: len(episodes[0].sample.loss_mask)] == episodes[0].sample.loss_mask
    (mb,), seq_len = micro_batches(batch, micro_batch_size=4)
    # the whole response, tool tokens included, is in the sequence the actor sees
    full = [1, 2, 3] + episodes[0].sample.response_ids
    assert mb.tokens[0, : len(full)].tolist() == full and seq_len == len(full) + 1


def test_max_turns_ends_without_running_the_last_call():
    episode = run(ScriptedPolicy([CALL]), max_turns=2)
    assert episode.finish == "max_turns" and len(episode.turns) == 2
    assert TOK.decode(episode.sample.response_ids).count("<tool_response>") == 1


def test_token_budget_ends_the_episode():
    episode = run(ScriptedPolicy([CALL]), budget=12, max_turns=5)
    assert episode.finish == "budget"
    assert len(episode.sample.response_ids) <= 12


@pytest.mark.parametrize(
    "text, kind",
    [
        ("<tool_call>{not json}</tool_call>", "invalid_json"),
        ('<tool_call>{"name": "lookup"', "invalid_json"),
        ('<tool_call>{"name": "weather", "arguments": {}}</tool_call>', "unknown_tool"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": 4}}</tool_call>', "tool_error"),
    ],
)
def test_bad_calls_become_error_observations_and_are_counted(text, kind):
    episode = run(ScriptedPolicy([text, "3"]))
    assert episode.errors == {kind: 1} and episode.finish == "answer"
    assert "error:" in TOK.decode(episode.sample.response_ids)
    assert episode_metrics([episode])[f"agent/errors/{kind}"] == 1.0


class Hangs(Tool):
    async def execute(self, arguments, state, **kwargs):
        await asyncio.sleep(3600)


class Raises(Tool):
    async def execute(self, arguments, state, **kwargs):
        raise KeyError("bug in the tool")


register_tool(Hangs("test_hangs", "never answers", {"type": "object"}), overwrite=True)
register_tool(Raises("test_raises", "raises", {"type": "object"}), overwrite=True)


@pytest.mark.parametrize("name, kind", [("test_hangs", "timeout"), ("test_raises", "tool_error")])
def test_hanging_or_raising_tool_is_an_error_observation(name, kind):
    call = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'
    episode = run(ScriptedPolicy([call, "1"]), tools={"tools_kwargs": {name: {}}}, timeout=0.2)
    assert episode.errors == {kind: 1} and episode.finish == "answer"


def test_max_tool_errors_ends_the_episode():
    episode = run(ScriptedPolicy(["<tool_call>{</tool_call>"]), max_turns=4, max_errors=2)
    assert episode.finish == "tool_errors" and episode.errors["invalid_json"] == 2


def test_episodes_run_concurrently_up_to_the_limit():
    policy = ScriptedPolicy(["9"], pause=0.01)
    settings = AgentSettings(2, 32, 8, 1.0)
    loop = AgentLoop(policy, TOK, get_chat_format("hermes"), settings, {}, max_concurrency=6)
    jobs = [([1, 2, i], ToolSet.for_sample([], None), i) for i in range(20)]
    episodes = asyncio.run(loop.run_episodes(jobs))
    assert [e.sample.prompt_ids[-1] for e in episodes] == list(range(20))
    assert policy.max_in_flight == 6


def test_parser_and_calculator():
    fmt = get_chat_format("hermes")
    calls = fmt.parse(
        'a<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*(3+4)\\"}"}</tool_call>'
    )
    assert calls == [ToolCall("calculator", {"expression": "2*(3+4)"})]
    assert isinstance(fmt.parse("<tool_call>[1]</tool_call>")[0], CallError)
    assert evaluate_arithmetic("2*(3+4) - 1/4") == 13.75
    tool = get_tool("calculator")
    assert asyncio.run(tool.execute({"expression": "7 // 2"}, {})) == "3"
    for bad in ("__import__('os')", "2**10**9", "1/0"):
        with pytest.raises(Exception, match="not allowed|too large|division"):
            evaluate_arithmetic(bad)
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        ToolSet.for_sample([], {"tools_kwargs": {"nope": {}}})


def test_the_tiny_tokenizer_with_tools_keeps_the_default_ids():
    plain = build_tiny_tokenizer(None)
    assert len(plain) == 63 and len(TOK) == 76
    assert all(TOK.convert_tokens_to_ids(t) == i for t, i in plain.get_vocab().items())
    for text in (CALL, '<tool_call>{"name": "python", "arguments": {"code": "print([1])"}}</tool_call>'):
        ids = TOK.encode(text, add_special_tokens=False)
        assert TOK.decode(ids) == text and TOK.unk_token_id not in ids


def test_episode_over_a_real_embedded_server():
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.rollout.client import RolloutClient
    from mcore_rl.rollout.server import ServerThread, build_server

    server = ServerThread(build_server(tiny_qwen3_moe(vocab_size=76), max_running_requests=16))
    client = RolloutClient(server.url)
    try:
        settings = AgentSettings(3, 24, 6, 1.0)
        params = {"temperature": 1.0, "stop_token_ids": [EOS], "skip_special_tokens": False, "no_stop_trim": True}
        loop = AgentLoop(client, TOK, get_chat_format("hermes"), settings, params)
        prompt = TOK.encode(
            TOK.apply_chat_template(
                [{"role": "user", "content": "lookup: 7"}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        jobs = [(prompt, ToolSet.for_sample([], LOOKUP), i) for i in range(8)]
        episodes = client.run(loop.run_episodes(jobs))
    finally:
        client.close()
        server.stop()
    for e in episodes:
        s = e.sample
        assert len(s.loss_mask) == len(s.response_ids) == len(s.response_logprobs) <= 24
        assert sum(t.end - t.start for t in e.turns) == sum(s.loss_mask)
        assert all(torch.tensor(s.loss_mask[t.start : t.end]).all() for t in e.turns)


def test_every_data_parallel_shard_gets_the_whole_batchs_length():
    # Expert parallelism's all-gather dispatcher needs one shape on every rank; multi-turn lengths vary a lot.
    episodes = [run(ScriptedPolicy([CALL, "3"])), run(ScriptedPolicy(["9"]))]
    batch, _ = samples_to_batch([e.sample for e in episodes], n=2)
    lengths = {micro_batches(batch.shard(r, 2), 4, min_seq_len=sequence_length(batch))[1] for r in range(2)}
    assert lengths == {sequence_length(batch)}


def test_python_tool_runs_in_the_sandbox():
    from mcore_rl.reward.sandbox import SandboxUnavailable

    tool = get_tool("python")
    try:
        tool.sandbox().check()
    except SandboxUnavailable as exc:
        pytest.skip(f"this machine cannot isolate generated code: {exc}")
    call = '<tool_call>{"name": "python", "arguments": {"code": "import os\\nprint(6*7, len(os.environ))"}}</tool_call>'
    episode = run(ScriptedPolicy([call, "42"]), tools={"tools_kwargs": {"python": {}}}, timeout=30)
    assert not episode.errors
    # the sandbox's stripped environment (4 variables), not this process's
    assert "<tool_response>\n42 4\n\n</tool_response>" in TOK.decode(episode.sample.response_ids)
    loop = "while 1: pass"  # the tiny vocabulary has no upper case
    hang = f'<tool_call>{{"name": "python", "arguments": {{"code": "{loop}"}}}}</tool_call>'
    tools = {"tools_kwargs": {"python": {"execute_kwargs": {"timeout_s": 1}}}}
    episode = run(ScriptedPolicy([hang, "1"]), tools=tools, timeout=30)
    assert episode.errors == {"tool_error": 1} and "timeout" in TOK.decode(episode.sample.response_ids)


def test_lookup_rows_and_reward(tmp_path):
    from mcore_rl.data.dataset import PromptDataset
    from mcore_rl.data.synthetic import write_synthetic_dataset
    from mcore_rl.reward.loader import default_compute_score

    path = write_synthetic_dataset(str(tmp_path / "lookup.parquet"), 20, 0, task="lookup")
    rows = PromptDataset([path], TOK, 64)
    keys = [r["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["key"] for r in rows]
    values = [r["ground_truth"] for r in rows]
    assert sorted(keys) == sorted(list(range(10)) * 2) and sorted(values) == sorted([str(d) for d in range(10)] * 2)
    row = rows[0]
    key, value = keys[0], values[0]
    toolset = ToolSet.for_sample([], row["extra_info"])
    assert asyncio.run(toolset.tools["lookup"].execute({"key": key}, toolset.states["lookup"])) == value

    def score(text: str) -> float:
        return default_compute_score("synthetic/lookup", text, value, row["extra_info"])["score"]

    store = row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["store"]
    assert sorted(store) == [str(d) for d in range(10)] and store[key] == value  # another key, another value
    wrong_key = (key + 1) % 10
    other = store[wrong_key]
    assert asyncio.run(toolset.tools["lookup"].execute({"key": wrong_key}, toolset.states["lookup"])) == other

    call = CALL.replace("7", str(key))
    wrong = CALL.replace("7", str(wrong_key))

    def reply(v: str) -> str:
        return f"\nuser\n<tool_response>\n{v}\n</tool_response>\nassistant\n"

    assert score(call + reply(value) + value) == 1.0
    assert score(call + reply(value) + value + "1") == pytest.approx(0.65)  # did not stop after the answer
    assert score(call) == pytest.approx(0.4)  # the whole call with the prompt's key, no answer yet
    assert score(wrong) == pytest.approx(0.25)  # another key: the call's pieces only
    assert score(wrong + reply(other) + other) == pytest.approx(0.6)  # ... relaying what the tool said
    assert score(wrong + reply(other) + value) == pytest.approx(0.25)  # ... the right digit it could not have read
    head = '<tool_call>{"name": "lookup", "arguments": {"key": '
    assert score(head + "}}</tool_call>") == pytest.approx(0.1)  # no key: the closings earn nothing
    assert score("<tool_call>}}</tool_call>") == pytest.approx(0.05)  # pieces count only in the call's order
    assert score(value) == 0.0  # a guess without the tool
    assert score("") == 0.0
