"""The tiny task: arithmetic chains with an exact verifier, a small model and its supervised warm start.

The task's contract files (:mod:`verl_group_ppo.tasks.contract`):

* :mod:`.spec`: its launcher runs (``TASK=tiny``, single- and multi-turn) and its entry in the task list;
* :mod:`.variants`: the single-turn task and the tool task, one record each;
* :mod:`.prepare`: ``python -m verl_group_ppo.tasks.tiny.prepare --output-dir DIR [--variant tools]`` writes a
  warm-started HF model and verl-format data for verl's ``main_ppo``;
* :mod:`.reward`: the score of one of its rows (the one reward function hands them here).

Its parts: :mod:`.problems` (the problem sets and their verifiers), :mod:`.chat` (chat templates and the trained
BPE tokenizer), :mod:`.tokenizer` (a character-level tokenizer), :mod:`.model` (a small Qwen2-architecture policy
and critic, batched sampling and scoring), :mod:`.warmstart` (the supervised warm start), :mod:`.evaluation`
(verifier rewards and held-out accuracy), and the tool task: :mod:`.tooluse`, :mod:`.tool_episodes`, with verl's
side of it, the ``add`` function tool file :mod:`.calculator_tool` and the ``tinycalc`` call format
:mod:`.tool_parser`.

The CPU backend (:mod:`verl_group_ppo.cpu`) knows nothing of it.
"""
