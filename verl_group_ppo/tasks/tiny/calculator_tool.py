"""The tiny tool task's calculator as a verl function tool, and its call format.

Point verl at this file (verl executes it as a file; it is not imported as a module)::

    actor_rollout_ref.rollout.multi_turn.function_tool_path=$(python -c "import verl_group_ppo.tasks.tiny.calculator_tool as m; print(m.__file__)")
    actor_rollout_ref.rollout.multi_turn.format=tinycalc

Loading it registers the ``add`` tool and the ``tinycalc`` tool-call format
(:mod:`verl_group_ppo.tasks.tiny.tool_parser`) in the agent-loop worker. examples/cpu/common.sh sets both for
the multi-turn launchers.
"""

from verl.tools.function_tool import function_tool

from verl_group_ppo.tasks.tiny import tool_parser, tooluse

tool_parser.register()


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the running total so far.
        b: the next term, negative to subtract.
    """
    return str(tooluse.add(a, b))
