"""``calculator``: a tool-use environment with one tool that evaluates arithmetic expressions.

The tool ``calculator(expression)`` evaluates integers and decimals with ``+ - * / // % **`` and
parentheses (Python's precedence) by walking the parsed expression, never ``eval``; exponents are
bounded (|exponent| <= 64, |result| < 10**100) so a call cannot hang. A bad expression is the
model's error (shown to it), not a tool failure. Integral results print as integers (``6``, not
``6.0``).
"""

from __future__ import annotations

import ast
import operator
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import FunctionTool, Tool, ToolArgumentError

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10**100
_MAX_CHARS = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolArgumentError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolArgumentError("division by zero") from None
        if isinstance(value, complex):
            raise ToolArgumentError("the result is not a real number")
        if abs(value) >= _MAX_MAGNITUDE:
            raise ToolArgumentError("the result is too large")
        return value
    raise ToolArgumentError(f"unsupported element '{ast.unparse(node)}'; "
                            "use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (see module docstring)."""
    if len(expression) > _MAX_CHARS:
        raise ToolArgumentError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolArgumentError(f"cannot parse {expression!r} as an arithmetic expression") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator_tool() -> Tool:
    return FunctionTool(
        calculate,
        name="calculator",
        description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. 347*29"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    )


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool; the final answer is scored by the RewardEngine."""
    name = "calculator"

    def make_tools(self) -> list[Tool]:
        return [calculator_tool()]
