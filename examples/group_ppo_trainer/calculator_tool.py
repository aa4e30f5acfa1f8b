"""A calculator for the GSM8K tool-calling recipe, as a verl function tool.

The recipe points verl at this file (``actor_rollout_ref.rollout.multi_turn.function_tool_path``); verl executes
it and registers ``calculate``. The model calls it in verl's ``hermes`` format
(``<tool_call>{"name": "calculate", "arguments": {"expression": "48 / 2 + 7"}}</tool_call>``) and reads the
result in the next turn. It evaluates arithmetic only (numbers, + - * / // % **, parentheses), never Python,
and it does not know the answer: the reward is verl's GSM8K rule on the final ``####`` answer.
"""

import ast
import operator

from verl.tools.function_tool import function_tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression.replace(",", "").replace("^", "**").strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}: {err.msg}") from None
    return value(tree.body)


def format_number(x: float) -> str:
    """An integer without a decimal point; anything else with up to 6 decimals, trailing zeros dropped."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "48 / 2 + 7".
    """
    try:
        return format_number(evaluate(expression))
    except (ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"
