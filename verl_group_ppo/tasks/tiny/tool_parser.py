"""The ``tinycalc`` tool-call format for verl's tool agent loop (``multi_turn.format=tinycalc``).

verl's ``ToolAgentLoop`` asks a registered ``ToolParser`` for the calls in each assistant turn. The tiny
tool task writes a call of ``add(a, b)`` as the step's arithmetic between two markers,
``<tool_call>11-3</tool_call>`` (:mod:`verl_group_ppo.tasks.tiny.tooluse`): a few tokens for a 0.5M-parameter
model, where verl's ``hermes`` JSON would be dozens. :func:`register` adds the format to verl's registry;
the tool file :mod:`verl_group_ppo.tasks.tiny.calculator_tool` calls it, so every agent-loop worker that loads
the tool knows the format.
"""

from __future__ import annotations

import json
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

from .tooluse import TOOL_FORMAT, TOOL_NAME, parse_calls


class TinyCalcToolParser(ToolParser):
    """Calls of ``add`` written as ``<tool_call>A+B</tool_call>`` or ``<tool_call>A-B</tool_call>``."""

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
        """The turn's text without its calls, and one ``FunctionCall`` of ``add`` per call (arguments as JSON)."""
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        content, calls = parse_calls(text)
        return content, [FunctionCall(name=TOOL_NAME, arguments=json.dumps({"a": a, "b": b})) for a, b in calls]


def register() -> None:
    """Register :class:`TinyCalcToolParser` under ``tinycalc`` (again is a no-op; another class under that
    name is an error)."""
    existing = ToolParser._registry.get(TOOL_FORMAT)
    if existing is not None and existing is not TinyCalcToolParser:
        raise ValueError(f"verl's ToolParser registry already holds {existing.__name__} under {TOOL_FORMAT!r}")
    ToolParser.register(TOOL_FORMAT)(TinyCalcToolParser)
