"""Tools an agent episode may call: registered by name with a JSON schema, configured per sample.

    tool = get_tool("calculator")               # the registry (TOOLS) is the list of tools a config may name
    state = tool.create(**create_kwargs)        # per episode, from verl's extra_info.tools_kwargs[name].create_kwargs
    text = await tool.execute(arguments, state) # arguments already checked against tool.parameters (JSON schema)

verl's parquet convention selects and configures a sample's tools:
`extra_info = {"tools_kwargs": {"lookup": {"create_kwargs": {"key": 7, "value": "3"}}}}`: the keys name the tools the
sample may use, `create_kwargs` go to `create`, `execute_kwargs` are passed to every `execute` of that episode.

Built-ins:
- `calculator`: + - * / // % ** and parentheses over numbers, evaluated on the expression's syntax tree (never
  `eval`), with bounded exponents and magnitudes;
- `python`: runs the code in `mcore_rl.reward.sandbox` (namespaces, rlimits, wall-clock kill), stdout back;
- `lookup`: the synthetic multi-turn task's key -> value store (configs/multiturn_tool.yaml): the answer is only
  in the tool, never in the prompt.
A tool that raises or exceeds its time limit becomes an error observation in the episode (loop.py), not a crash.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from mcore_rl.reward.rule import lookup_table


class ToolFailure(RuntimeError):
    """A tool ran but could not answer (bad expression, sandbox error ...): the message becomes the observation."""


@dataclass
class Tool:
    """A tool: name, description and JSON-schema `parameters` as in an OpenAI function definition."""

    name: str
    description: str
    parameters: dict[str, Any]
    timeout_s: float = 10.0  #: default wall-clock limit of one call (the agent config may lower it)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen3 function definition (what a chat template renders into the system prompt)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: Any) -> str | None:
        """None if `arguments` satisfy the schema, else what is wrong (the observation the model gets)."""
        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as err:
            where = "/".join(str(p) for p in err.absolute_path) or "arguments"
            return f"{where}: {err.message}"
        return None

    def create(self, **create_kwargs: Any) -> dict[str, Any]:
        """Per-episode state from the sample's create_kwargs (none by default)."""
        if create_kwargs:
            raise ToolFailure(f"tool {self.name!r} takes no create_kwargs, got {sorted(create_kwargs)}")
        return {}

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any], **execute_kwargs: Any) -> str:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------- calculator
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_ABS = 1e100  # beyond this an expression is refused rather than computed (2**10**9 would take minutes)


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolFailure naming what is not allowed."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ToolFailure(f"not an arithmetic expression: {err.msg}") from err

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 1000 or abs(left) > 1e6):
                raise ToolFailure("exponent or base too large")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError as err:
                raise ToolFailure("division by zero") from err
            if isinstance(value, complex) or abs(value) > _MAX_ABS:
                raise ToolFailure("result out of range")
            return value
        raise ToolFailure(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")

    return walk(tree)


class Calculator(Tool):
    def __init__(self) -> None:
        super().__init__(
            "calculator",
            "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 512}},
                "required": ["expression"],
                "additionalProperties": False,
            },
            timeout_s=5.0,
        )

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any], **execute_kwargs: Any) -> str:
        value = evaluate_arithmetic(arguments["expression"])
        return repr(value) if isinstance(value, float) else str(value)


# -------------------------------------------------------------------------------------------------------- python
class PythonTool(Tool):
    """Python through the code sandbox (one isolated process tree per call; the sandbox's own timeout kills it)."""

    def __init__(self) -> None:
        super().__init__(
            "python",
            "Run a Python program in a sandbox (no network, no files outside /tmp) and return its standard output.",
            {
                "type": "object",
                "properties": {"code": {"type": "string", "maxLength": 65536}, "stdin": {"type": "string"}},
                "required": ["code"],
                "additionalProperties": False,
            },
            timeout_s=30.0,
        )
        self._sandbox: Any = None

    def sandbox(self) -> Any:
        if self._sandbox is None:
            from mcore_rl.reward.sandbox import Sandbox

            self._sandbox = Sandbox()
        return self._sandbox

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any], **execute_kwargs: Any) -> str:
        timeout_s = float(execute_kwargs.get("timeout_s", 10.0))
        # The sandbox blocks (it supervises a process tree), so it runs on a thread; it kills the program itself at
        # its deadline, so the thread always ends.
        result = await asyncio.to_thread(self.sandbox().run, arguments["code"], arguments.get("stdin", ""), timeout_s)
        if result.status == "ok":
            return result.stdout
        raise ToolFailure(f"{result.status}: {result.reason or result.stderr[-500:]}")


# -------------------------------------------------------------------------------------------------------- lookup
class Lookup(Tool):
    """The synthetic task's store, one per episode: create_kwargs key and value (the answer), and optionally the
    whole store, a list whose item i is the value under key i (it must hold the value under the key)."""

    def __init__(self) -> None:
        super().__init__(
            "lookup",
            "Look up the value stored under an integer key.",
            {
                "type": "object",
                "properties": {"key": {"type": "integer"}},
                "required": ["key"],
                "additionalProperties": False,
            },
            timeout_s=5.0,
        )

    def create(self, **create_kwargs: Any) -> dict[str, Any]:
        unknown = set(create_kwargs) - {"key", "value", "store"}
        if unknown or "key" not in create_kwargs or "value" not in create_kwargs:
            raise ToolFailure(
                f"lookup needs create_kwargs key and value (and optionally store), got {sorted(create_kwargs)}"
            )
        key, value = str(create_kwargs["key"]), str(create_kwargs["value"])
        state = lookup_table(key, value, create_kwargs.get("store"))
        if state.get(key) != value:
            raise ToolFailure(f"lookup create_kwargs: store[{key}] is {state.get(key)!r}, expected the value {value!r}")
        return state

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any], **execute_kwargs: Any) -> str:
        key = str(arguments["key"])
        if key not in state:
            raise ToolFailure(f"no value under key {key}")
        return state[key]


TOOLS: dict[str, Tool] = {}
"""Every tool by name: what `agent.tools` and a sample's tools_kwargs may name."""


def register_tool(tool: Tool, overwrite: bool = False) -> Tool:
    """Add a tool to the registry (a user's own tools: subclass Tool, register before the run starts)."""
    if tool.name in TOOLS and not overwrite:
        raise ValueError(f"a tool named {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    """The registered tool; ValueError listing the known names."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; registered tools: {sorted(TOOLS)}")
    return TOOLS[name]


for _tool in (Calculator(), PythonTool(), Lookup()):
    register_tool(_tool)


@dataclass
class ToolSet:
    """The tools one episode may call, with their per-episode state and execute_kwargs."""

    tools: dict[str, Tool]
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    execute_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def for_sample(cls, default_tools: list[str], extra_info: dict[str, Any] | None) -> ToolSet:
        """verl's `extra_info.tools_kwargs` selects and configures the sample's tools; without it, `default_tools`."""
        tools_kwargs = (extra_info or {}).get("tools_kwargs") or {}
        # parquet stores tools_kwargs as a struct over every row's tools: a tool another row uses is None here
        tools_kwargs = {k: v for k, v in tools_kwargs.items() if v is not None}
        names = list(tools_kwargs) if tools_kwargs else list(default_tools)
        out = cls({name: get_tool(name) for name in names})
        for name in names:
            kwargs = tools_kwargs.get(name) or {}
            out.states[name] = out.tools[name].create(**(kwargs.get("create_kwargs") or {}))
            out.execute_kwargs[name] = dict(kwargs.get("execute_kwargs") or {})
        return out
