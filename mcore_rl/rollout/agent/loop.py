"""The multi-turn agent loop: the model generates, its tool calls run, their responses go back as tokens, repeat.

```
context = prompt
turn:  client.agenerate_one(context, 1)        model tokens   -> response (loss mask 1, their logprobs)
       chat_format.parse(turn text)            no call        -> the episode ends ("answer")
       tools.execute(calls) (schema-checked,   observations   -> chat_format.tool_responses -> tokens
       time-limited, errors as observations)                     -> response (loss mask 0, logprob 0)
       context = prompt + response
ends:  answer | length (a turn cut by the per-turn token limit, with no call in it)
       | max_turns (a call in the last allowed turn is not run) | budget (max_response_tokens reached)
       | tool_errors (agent.max_tool_errors error observations)
```
Every episode is one `Sample`: `response_ids` is everything after the prompt (model and tool tokens interleaved),
`loss_mask` marks the model's tokens, `response_logprobs` hold each model token's rollout logprob (0 elsewhere),
`weight_versions` the version spans of the model's tokens (turns generated across a weight update carry both).
The episode's turns (`Episode.turns`: start, end, logprobs, calls) keep the per-turn view. Episodes run
concurrently on the rollout client's event loop, at most `max_concurrency` at a time.

Bad tool calls become error observations (the model reads what went wrong, as Qwen3's format expects) and are
counted by kind in `AgentMetrics`: invalid_json, unknown_tool, bad_arguments, tool_error (raised), timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.rollout.agent.parser import CallError, ChatFormat, ToolCall
from mcore_rl.rollout.agent.tools import ToolFailure, ToolSet
from mcore_rl.rollout.sampling import Sample

log = logging.getLogger(__name__)

ERROR_KINDS = ("invalid_json", "unknown_tool", "bad_arguments", "tool_error", "timeout")
FINISH_REASONS = ("answer", "length", "max_turns", "budget", "tool_errors")


@dataclass
class Turn:
    """One model turn of an episode: response tokens [start, end), their logprobs, the calls it made."""

    start: int
    end: int
    logprobs: list[float]
    calls: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Episode:
    """One finished episode: the sample the trainer sees, its turns, and why it ended."""

    sample: Sample
    turns: list[Turn]
    finish: str
    errors: Counter = field(default_factory=Counter)


@dataclass
class AgentSettings:
    """What one episode needs to know (from the `agent` and `rollout` config groups)."""

    max_turns: int
    max_response_tokens: int
    max_new_tokens_per_turn: int
    tool_timeout_s: float
    max_tool_errors: int | None = None


class AgentLoop:
    """Runs episodes over a rollout client (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        chat_format: ChatFormat,
        settings: AgentSettings,
        sampling_params: dict[str, Any],
        max_concurrency: int = 64,
    ) -> None:
        self.client, self.tokenizer, self.format, self.settings = client, tokenizer, chat_format, settings
        self.sampling_params = sampling_params
        self.max_concurrency = max_concurrency

    async def run_episodes(self, jobs: list[tuple[list[int], ToolSet, int | None]]) -> list[Episode]:
        """(prompt ids, tools, seed) per episode -> episodes in the same order, run concurrently."""
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(prompt: list[int], tools: ToolSet, seed: int | None) -> Episode:
            async with limit:
                return await self.run_episode(prompt, tools, seed)

        return list(await asyncio.gather(*(one(*job) for job in jobs)))

    async def run_episode(self, prompt: list[int], tools: ToolSet, seed: int | None = None) -> Episode:
        """One episode from `prompt` with `tools` (see the module docstring)."""
        s = self.settings
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        spans: list[tuple[int | str, int, int]] = []
        turns: list[Turn] = []
        errors: Counter = Counter()
        finish, version = "max_turns", None
        for turn_index in range(s.max_turns):
            budget = s.max_response_tokens - len(response)
            if budget <= 0:
                finish = "budget"
                break
            params = dict(self.sampling_params, max_new_tokens=min(s.max_new_tokens_per_turn, budget))
            turn_seed = None if seed is None else seed + 104_729 * turn_index
            (out,) = await self.client.agenerate_one(prompt + response, 1, params, seed=turn_seed)
            start = len(response)
            response += out.response_ids
            mask += [1] * len(out.response_ids)
            logprobs += out.response_logprobs
            spans += [(v, a + start, b + start) for v, a, b in out.weight_versions]
            version = out.weight_version
            turn = Turn(start, len(response), list(out.response_logprobs))
            turns.append(turn)
            text = self.tokenizer.decode(out.response_ids, skip_special_tokens=False)
            calls = self.format.parse(text)
            turn.calls = len(calls)
            if not calls:
                finish = "answer" if out.finish_reason == "stop" else "length"
                break
            if turn_index == s.max_turns - 1:
                break  # no turn left to read the responses: they are not run
            observations = await asyncio.gather(*(self._call(c, tools) for c in calls))
            for kind, _ in observations:
                if kind is not None:
                    errors[kind] += 1
                    turn.errors.append(kind)
            text = self.format.tool_responses([o for _, o in observations], turn_ended=out.finish_reason == "stop")
            tool_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(response) + len(tool_ids) >= s.max_response_tokens:
                finish = "budget"  # no room for the responses and a model token after them
                break
            response += tool_ids
            mask += [0] * len(tool_ids)
            logprobs += [0.0] * len(tool_ids)
            if s.max_tool_errors is not None and sum(errors.values()) >= s.max_tool_errors:
                finish = "tool_errors"
                break
        sample = Sample(
            prompt_ids=list(prompt),
            response_ids=response,
            response_logprobs=logprobs,
            finish_reason="stop" if finish == "answer" else "length",
            weight_version=version if version is not None else "unknown",
            weight_versions=spans,
            loss_mask=mask,
        )
        return Episode(sample, turns, finish, errors)

    async def _call(self, call: ToolCall | CallError, tools: ToolSet) -> tuple[str | None, str]:
        """(error kind or None, observation text) for one parsed call."""
        if isinstance(call, CallError):
            return call.kind, call.message
        tool = tools.tools.get(call.name)
        if tool is None:
            return "unknown_tool", f"error: unknown tool {call.name!r}; available: {sorted(tools.tools)}"
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return "bad_arguments", f"error: invalid arguments for {call.name}: {problem}"
        timeout_s = min(tool.timeout_s, self.settings.tool_timeout_s)
        try:
            result = await asyncio.wait_for(
                tool.execute(call.arguments, tools.states[call.name], **tools.execute_kwargs[call.name]), timeout_s
            )
        except asyncio.TimeoutError:
            return "timeout", f"error: {call.name} did not answer within {timeout_s:g} s"
        except ToolFailure as err:
            return "tool_error", f"error: {err}"
        except Exception as err:  # noqa: BLE001 (a tool's bug must not end the run; the model sees it, metrics count it)
            log.warning("tool %s raised %s: %s", call.name, type(err).__name__, err)
            return "tool_error", f"error: {call.name} failed ({type(err).__name__}: {err})"
        return None, str(result)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Means per episode: turns, tool calls, error kinds, finish reasons, the share of model tokens."""
    n = max(len(episodes), 1)
    out = {
        "agent/turns": sum(len(e.turns) for e in episodes) / n,
        "agent/tool_calls": sum(t.calls for e in episodes for t in e.turns) / n,
        "agent/model_token_frac": sum(sum(e.sample.loss_mask or []) for e in episodes)
        / max(sum(len(e.sample.response_ids) for e in episodes), 1),
    }
    for kind in ERROR_KINDS:
        out[f"agent/errors/{kind}"] = sum(e.errors[kind] for e in episodes) / n
    for reason in FINISH_REASONS:
        out[f"agent/finish/{reason}"] = sum(e.finish == reason for e in episodes) / n
    return out
