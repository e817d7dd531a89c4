"""Chat formats for tool use: how a model's turn names tool calls, and how tool responses go back as text.

    fmt = get_chat_format("hermes")
    calls = fmt.parse(turn_text)                 # [ToolCall | CallError], in order of appearance
    text = fmt.tool_responses(["3", "error: ..."], turn_ended=True)   # tokenized and appended, loss mask 0

`hermes` is Qwen2.5/Qwen3's (and NousResearch Hermes') format:

    assistant turn:  ...<tool_call>\\n{"name": "lookup", "arguments": {"key": 7}}\\n</tool_call><|im_end|>
    tool responses:  \\n<|im_start|>user\\n<tool_response>\\n3\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(Qwen3's chat template renders `role: tool` messages as one user turn holding one <tool_response> block per call,
and opens the next assistant turn.) Another model family's format is another `ChatFormat` in `CHAT_FORMATS`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    """One well-formed call: a name and a JSON object of arguments (not yet checked against the tool's schema)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class CallError:
    """A call the parser could not read: `kind` is a metric name (invalid_json), `message` the observation."""

    kind: str
    message: str


class ChatFormat:
    """One family's tool-call markup (see the module docstring)."""

    name = ""

    def parse(self, text: str) -> list[ToolCall | CallError]:
        raise NotImplementedError

    def tool_responses(self, observations: list[str], turn_ended: bool) -> str:
        """The text that follows a model turn with tool calls: the tool turn and the next assistant turn's opening.
        `turn_ended`: the model closed its turn (eos); if not (the per-turn token limit cut it), it is closed here."""
        raise NotImplementedError


class HermesFormat(ChatFormat):
    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, turn_end: str = "<|im_end|>", turn_start: str = "<|im_start|>") -> None:
        self.turn_end, self.turn_start = turn_end, turn_start

    def parse(self, text: str) -> list[ToolCall | CallError]:
        out: list[ToolCall | CallError] = []
        for body in self._CALL.findall(text):
            out.append(_parse_call(body))
        # An opened call that never closes is a call the model botched, not plain text.
        if text.count("<tool_call>") > len(out):
            out.append(CallError("invalid_json", "error: <tool_call> without </tool_call>"))
        return out

    def tool_responses(self, observations: list[str], turn_ended: bool) -> str:
        close = "" if turn_ended else self.turn_end
        blocks = "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in observations)
        return f"{close}\n{self.turn_start}user\n{blocks}{self.turn_end}\n{self.turn_start}assistant\n"


def _parse_call(body: str) -> ToolCall | CallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return CallError("invalid_json", f"error: the tool call is not valid JSON ({err.msg} at {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError("invalid_json", 'error: a tool call must be {"name": <string>, "arguments": <object>}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models send arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return CallError("invalid_json", "error: the tool call's arguments string is not valid JSON")
    if not isinstance(arguments, dict):
        return CallError("invalid_json", "error: a tool call's arguments must be a JSON object")
    return ToolCall(obj["name"], arguments)


CHAT_FORMATS: dict[str, type[ChatFormat]] = {"hermes": HermesFormat}
"""Tool-call formats by name (`agent.chat_format`)."""


def get_chat_format(name: str) -> ChatFormat:
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; expected one of {sorted(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]()
