"""Tools an episode's policy may call between its answers: parsing the calls, running them in the sandbox.

A tool call is found in an answer's text in one of two formats (``environment.tool_format``):

* ``chat_template`` (Qwen 2.5 / 3, Hermes, and the transformers chat-template tool docs): a JSON object with
  ``name`` and ``arguments`` between ``<tool_call>`` and ``</tool_call>``::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "37 * 48"}}
      </tool_call>

* ``plain`` (any tokenizer, the word-level ones of the tiny jobs included): the tool's name and its argument
  text between ``<call>`` and ``</call>``, separated by whitespace; the argument text becomes the argument
  ``input``. Where the episode has one tool, its name may be left out (a first word that names no tool is then
  part of the argument text)::

      <call> calculator 3 7 * 4 8 </call>      ->  calculator(input="3 7 * 4 8")
      <call> 3 7 * 4 8 </call>                 ->  calculator(input="3 7 * 4 8")   (calculator the only tool)

A tool is a ``Tool``: a name and a function that turns the call's arguments into a Python program; the
program runs in the sandbox (``sandbox.run_program``, the code verifier's fences and limits) and what it
prints is the tool's output. ``calculator`` (arithmetic on integers and decimals; spaces between digits are
dropped, so ``3 7`` is 37) and ``python`` (runs ``code``, or the plain format's ``input``) are built in;
``register_tool`` adds one. Every way a call can fail (an unknown tool, arguments that do not parse, a program
that raises or overruns its time) gives a ``ToolResult`` whose ``status`` says which and whose ``output`` is one
line saying what went wrong: the policy sees that line as the observation and the run goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from restage.algorithms.sandbox import Limits, run_program
from restage.errors import ConfigError

ToolFormat = Literal["chat_template", "plain"]
TOOL_FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)
ToolStatus = Literal["ok", "unknown_tool", "malformed", "error", "timeout"]
TEMPLATE_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PLAIN_CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)
# The tokens that end a call in each format: the rollout stops a turn there, as it does at EOS.
CALL_END = {"chat_template": "</tool_call>", "plain": "</call>"}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (the plain format's argument text under ``input``);
    ``problem`` is a one-line reason when the call's text did not parse (then ``name`` may be empty)."""

    name: str
    arguments: Mapping[str, object]
    problem: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: its status and its output (what the program printed, or one line naming the failure)."""

    call: ToolCall
    status: ToolStatus
    output: str


@dataclass(frozen=True)
class Tool:
    """A tool: ``program(arguments)`` is the Python source the sandbox runs; it may raise ``ValueError`` with one
    line when the arguments are wrong (a ``malformed`` result)."""

    name: str
    description: str
    program: Callable[[Mapping[str, object]], str]


def parse_tool_calls(text: str, tool_format: ToolFormat, only_tool: str = "") -> list[ToolCall]:
    """Every tool call in an answer's text, in order; a call whose text does not parse is kept with its ``problem``.
    ``only_tool``: the episode's one tool, which a plain call may leave unnamed."""
    match tool_format:
        case "chat_template":
            return [_template_call(body) for body in TEMPLATE_CALL.findall(text)]
        case "plain":
            return [_plain_call(body, only_tool) for body in PLAIN_CALL.findall(text)]
    raise ConfigError(f"environment.tool_format: {tool_format!r} must be one of {', '.join(TOOL_FORMATS)}")


def _template_call(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except ValueError as err:
        return ToolCall("", {}, f"the tool call is not JSON ({err})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'the tool call needs a JSON object with a string "name"')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(data["name"], {}, "the tool call's arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, "the tool call's arguments are not a JSON object")
    return ToolCall(data["name"], arguments)


def _plain_call(body: str, only_tool: str = "") -> ToolCall:
    name, _, rest = body.strip().partition(" ")
    if only_tool and name != only_tool:
        return ToolCall(only_tool, {"input": body.strip()})
    if not name:
        return ToolCall("", {}, "the tool call names no tool (write <call> NAME ARGUMENTS </call>)")
    return ToolCall(name, {"input": rest.strip()})


def _argument(arguments: Mapping[str, object], *names: str) -> str:
    for name in names:
        value = arguments.get(name)
        if isinstance(value, str):
            return value
    raise ValueError(f"the call needs a string argument {' or '.join(map(repr, names))}")


ARITHMETIC = re.compile(r"[0-9.+\-*/%() ]*")


def calculator_program(arguments: Mapping[str, object]) -> str:
    """Evaluate an arithmetic expression (digits, ``+ - * / % ( )``); spaces between digits are dropped."""
    expression = _argument(arguments, "expression", "input")
    if not expression.strip() or not ARITHMETIC.fullmatch(expression):
        raise ValueError(f"calculator takes digits and + - * / % ( ) only, got {expression[:40]!r}")
    joined = re.sub(r"(?<=[0-9.]) +(?=[0-9.])", "", expression)
    # Still checked by ``ast`` in the sandbox: only numbers and arithmetic operators are evaluated.
    return ("import ast, operator as o\n"
            f"tree = ast.parse({joined!r}, mode='eval')\n"
            "ops = {ast.Add: o.add, ast.Sub: o.sub, ast.Mult: o.mul, ast.Div: o.truediv, ast.Mod: o.mod,\n"
            "       ast.USub: o.neg, ast.UAdd: o.pos}\n"
            "def ev(n):\n"
            "    if isinstance(n, ast.Expression): return ev(n.body)\n"
            "    if isinstance(n, ast.Constant) and type(n.value) in (int, float): return n.value\n"
            "    if isinstance(n, ast.BinOp) and type(n.op) in ops: return ops[type(n.op)](ev(n.left), ev(n.right))\n"
            "    if isinstance(n, ast.UnaryOp) and type(n.op) in ops: return ops[type(n.op)](ev(n.operand))\n"
            "    raise ValueError('not arithmetic')\n"
            "v = ev(tree)\n"
            "print(int(v) if float(v).is_integer() else round(v, 6))\n")


def python_program(arguments: Mapping[str, object]) -> str:
    return _argument(arguments, "code", "input")


_TOOLS: dict[str, Tool] = {
    "calculator": Tool("calculator", "evaluate an arithmetic expression", calculator_program),
    "python": Tool("python", "run Python code and return what it prints", python_program),
}


def register_tool(tool: Tool) -> None:
    """Make ``tool`` callable by its name in episodes whose ``environment.tools`` list it."""
    _TOOLS[tool.name] = tool


def tool_names() -> tuple[str, ...]:
    return tuple(_TOOLS)


def resolve_tools(names: tuple[str, ...] | list[str]) -> dict[str, Tool]:
    """The tools ``environment.tools`` names; a one-line ConfigError for one that is not registered."""
    unknown = [n for n in names if n not in _TOOLS]
    if unknown:
        raise ConfigError(f"environment.tools: {', '.join(map(repr, unknown))} is not a registered tool; use "
                          f"{', '.join(_TOOLS)} or register_tool(...) one")
    return {n: _TOOLS[n] for n in names}


def run_tool(call: ToolCall, tools: Mapping[str, Tool], limits: Limits, namespaces: bool = True,
             max_output_chars: int = 512) -> ToolResult:
    """Run one call in the sandbox; every failure is a result with a one-line output, never an exception."""
    if call.problem:
        return ToolResult(call, "malformed", f"error: {call.problem}")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call, "unknown_tool",
                          f"error: unknown tool {call.name[:40]!r}; the tools are {', '.join(tools) or 'none'}")
    try:
        program = tool.program(call.arguments)
    except ValueError as err:
        return ToolResult(call, "malformed", f"error: {str(err).splitlines()[0] if str(err) else 'bad arguments'}")
    run = run_program(program, "", limits, namespaces, max_output_chars)
    if run.timed_out:
        return ToolResult(call, "timeout", f"error: {call.name} timed out after {limits.timeout_seconds:g} s")
    if not run.finished:
        return ToolResult(call, "error", f"error: {call.name} failed: {run.error or 'it did not finish'}"[:max_output_chars])
    return ToolResult(call, "ok", run.stdout)
