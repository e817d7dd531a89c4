"""A step's batch from multi-turn tool episodes (agent.enabled): prompts -> agent loop over the engines -> reward.

    producer = AgentProducer(cfg, loader, engines, reward, tokenizer)
    rollouts = producer.produce(step, timer)   # the same Rollouts as single-turn; response_mask 0 on tool tokens

Each prompt's `rollout.n` episodes run concurrently with every other prompt's on the rollout client's event loop
(mcore_rl/rollout/agent/loop.py); a sample's tools come from its extra_info.tools_kwargs (verl's convention) or
`agent.tools`. The prompt is rendered again with the sample's tool definitions (`apply_chat_template(tools=...)`,
as verl does: Qwen3's template lists them in the system turn; a template that ignores tools gives the dataset's
tokens). The reward function sees the whole decoded response, tool turns included.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.config import RLConfig
from mcore_rl.controller.producer import PROMPT_FIELDS, RolloutProducer, Rollouts
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.metrics.logger import StepTimer
from mcore_rl.rollout.agent.loop import AgentLoop, AgentSettings, episode_metrics
from mcore_rl.rollout.agent.parser import get_chat_format
from mcore_rl.rollout.agent.tools import ToolFailure, ToolSet


class AgentProducer(RolloutProducer):
    """Multi-turn rollouts behind the single-turn producer's `produce`."""

    def __init__(self, cfg: RLConfig, loader: Any, engines: Any, reward: Any, tokenizer: Any) -> None:
        super().__init__(cfg, loader, engines, reward, tokenizer)
        agent, rollout = cfg.agent, cfg.rollout
        settings = AgentSettings(
            max_turns=agent.max_turns,
            max_response_tokens=agent.max_response_tokens,
            max_new_tokens_per_turn=rollout.max_new_tokens,
            tool_timeout_s=agent.tool_timeout_s,
            max_tool_errors=agent.max_tool_errors,
        )
        params = {
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "stop_token_ids": self.eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        self.reward_metrics: dict[str, float] = {}
        self.loop = AgentLoop(
            engines.client, tokenizer, get_chat_format(agent.chat_format), settings, params, agent.max_concurrency
        )

    def tools_for(self, prompt: dict[str, Any]) -> ToolSet:
        """The prompt's tools; ValueError naming the row when its tools_kwargs cannot configure them."""
        try:
            return ToolSet.for_sample(self.cfg.agent.tools, prompt.get("extra_info"))
        except (ValueError, ToolFailure) as err:
            raise ValueError(f"prompt {prompt.get('index')}: extra_info.tools_kwargs: {err}") from err

    def prompt_ids(self, prompt: dict[str, Any], tools: ToolSet) -> list[int]:
        """The prompt's tokens with its tools' definitions in the chat template."""
        if not tools.tools:
            return prompt["prompt_token_ids"]
        schemas = [tool.schema() for tool in tools.tools.values()]
        text = self.tokenizer.apply_chat_template(
            prompt["raw_prompt"], tools=schemas, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def produce(self, step: int, timer: StepTimer) -> Rollouts:
        """Run `rollout.n` episodes per prompt and score them (laps `time/generate` and `time/reward`)."""
        n = self.cfg.rollout.n
        prompts = next(self.loader)
        seed = self.seed(step, len(prompts))
        # one ToolSet per episode: a tool's per-episode state is never shared between the n samples of a prompt
        tools = [[self.tools_for(p) for _ in range(n)] for p in prompts]
        ids = [self.prompt_ids(p, tools[i][0]) for i, p in enumerate(prompts)]
        jobs = [(ids[i], tools[i][j], seed + i * n + j) for i in range(len(prompts)) for j in range(n)]
        episodes = self.engines.client.run(self.loop.run_episodes(jobs))
        timer.lap("gen")
        samples = [e.sample for e in episodes]
        scores = self.score(prompts, samples, n)
        batch, group_ids = samples_to_batch(samples, n)
        timer.lap("reward")
        metrics = {**episode_metrics(episodes), **self.reward_metrics}
        return Rollouts(prompts, samples, scores, batch, group_ids, metrics=metrics)

    def score(self, prompts: list[dict[str, Any]], samples: list, n: int) -> Any:
        """As the single-turn producer's, keeping the reward's own metrics (e.g. the lookup task's `called` and
        `acc` means: whether the policy really fetched the answer with the tool)."""
        per_sample = {k: [p[k] for p in prompts for _ in range(n)] for k in PROMPT_FIELDS}
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        out = self.reward.score(texts, *(per_sample[k] for k in PROMPT_FIELDS))
        self.reward_metrics = {k: v for k, v in out.metrics.items() if k.startswith("reward/") and "/" not in k[7:]}
        return out.scores
