"""The maths-question task's reward, computed by verl through its own reward path.

verl's reward loop calls the package's one reward function, :func:`verl_group_ppo.reward.compute_score`
(``reward.custom_reward_function.path=pkg://verl_group_ppo.reward``), for every response; it hands the rows whose
``data_source`` is one of :data:`DATA_SOURCES` to :func:`compute_score` here.

The score is exact match of the final answer (:func:`verl_group_ppo.mathtask.answers.score_reply`): 1.0 or 0.0, and
0.0 for a reply without an answer. Two more fields go into verl's ``reward_extra_info`` and from there into its
validation metrics (``val-aux/verl_group_ppo/smollm2_math/answered/mean@1``, ``.../bare/...``): whether the reply
held an answer at all, and whether it was nothing but the answer. They tell a rise in reward that comes from the
answer format apart from one that comes from getting more answers right.
"""

from __future__ import annotations

from typing import Any

from .answers import score_reply
from .task import DATA_SOURCE

#: the ``data_source`` of the task's rows
DATA_SOURCES = frozenset([DATA_SOURCE])


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> dict[str, float]:
    """The task's score of one reply: ``{"score": 1.0 or 0.0, "answered": 0/1, "bare": 0/1}``."""
    if data_source not in DATA_SOURCES:
        raise ValueError(f"data_source: {data_source!r} is not the maths-question task's ({DATA_SOURCE!r})")
    scored = score_reply(solution_str, str(ground_truth))
    return {"score": scored.score, "answered": float(scored.answered), "bare": float(scored.bare)}
