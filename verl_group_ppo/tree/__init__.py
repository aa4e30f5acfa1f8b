"""Tree rollouts: a prompt's ``rollout.n`` replies sampled as one tree, each reply sampling only its own tail.

================================  =====================================================================
module                            holds
================================  =====================================================================
:mod:`.shape`                     :class:`TreeShape` (the ``tree_rollout`` keys), :func:`tree_plan` (who
                                  branches from whom), :func:`branch_position` (where)
:mod:`.assemble`                  :func:`child_reply`: a child's row from its parent's prefix and its tail
:mod:`.cost`                      the tree's token counts (``group/tree_*`` metrics)
:mod:`.coordinator`               :func:`sample_in_tree`, a prompt's samples meeting in a :class:`TreeRegistry`
:mod:`.agent_loop` (verl glue)    the ``tree_single_turn`` agent loop
================================  =====================================================================

Importing this package imports no verl module.
"""

from verl_group_ppo.tree.assemble import Reply, child_reply
from verl_group_ppo.tree.shape import (BRANCH_RULES, SHARED_PREFIX, TREE_PATH, SamplePlan, TreeShape,
                                       branch_position, tree_plan)

__all__ = ["BRANCH_RULES", "SHARED_PREFIX", "TREE_PATH", "Reply", "SamplePlan", "TreeShape", "branch_position",
           "child_reply", "tree_plan"]
