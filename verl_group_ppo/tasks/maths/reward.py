"""The maths-question task's reward: verl's score of one of its rows.

verl's reward loop calls the package's one reward function, :func:`verl_group_ppo.tasks.reward.compute_score`
(``reward.custom_reward_function.path=pkg://verl_group_ppo.tasks.reward``), for every response; it hands the rows whose
``data_source`` is one of :data:`DATA_SOURCES` to :func:`compute_score` here, which scores them with their variant's
``score`` (:mod:`verl_group_ppo.tasks.maths.task`):

* ``arith`` rows (``verl_group_ppo/arith/<module>``, one data source per module): 1.0 when the reply's final number
  equals the answer (:func:`~verl_group_ppo.tasks.maths.numeric.score_final_number`), with ``answered`` (the reply
  holds a number);
* ``twoway`` rows (``verl_group_ppo/smollm2_math``): exact match of the last answer-shaped item
  (:func:`~verl_group_ppo.tasks.maths.answers.score_reply`), with ``answered`` and ``bare`` (nothing but the answer).

The fields beside ``score`` go into verl's ``reward_extra_info`` and from there into its validation metrics, per data
source (``val-aux/verl_group_ppo/arith/mul_add/answered/mean@1``): they tell a rise in reward that comes from the
answer format apart from one that comes from getting more answers right.
"""

from __future__ import annotations

from typing import Any

from .task import ARITH_DATA_SOURCES, DATA_SOURCE, ArithTask, MathTask

#: the ``data_source`` of every row the task writes
DATA_SOURCES = frozenset([DATA_SOURCE]) | ARITH_DATA_SOURCES
#: the scorers import nothing beyond verl-group-ppo's requirements
SCORER_MODULES: tuple[str, ...] = ()
SCORER_EXTRA = ""


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> dict[str, float]:
    """The task's score of one reply: ``{"score": 1.0 or 0.0, "answered": 0/1}`` (and ``"bare"`` for twoway)."""
    if data_source in ARITH_DATA_SOURCES:
        return ArithTask.score(solution_str, str(ground_truth))
    if data_source == DATA_SOURCE:
        return MathTask.score(solution_str, str(ground_truth))
    raise ValueError(f"data_source: {data_source!r} is not the maths-question task's (one of {sorted(DATA_SOURCES)})")
