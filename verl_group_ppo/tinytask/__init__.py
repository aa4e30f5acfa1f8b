"""The tiny CPU task: arithmetic chains with an exact verifier, a small model and its supervised warm start.

* :mod:`.tasks`: the tasks and their verifiers; :mod:`.tokenizer`: a character-level tokenizer;
* :mod:`.model`: a small Qwen2-architecture policy and critic, batched sampling and scoring;
* :mod:`.warmstart`: the supervised warm start; :mod:`.evaluation`: verifier rewards and held-out accuracy;
* :mod:`.prepare`: ``python -m verl_group_ppo.tinytask.prepare --output-dir DIR`` writes a warm-started HF
  model and verl-format data for verl's ``main_ppo``; ``--variant tools`` the tool task (:mod:`.tooluse`);
* :mod:`.reward`: verl's custom reward function for those rows,
  ``reward.custom_reward_function.path=pkg://verl_group_ppo.tinytask.reward`` (name ``compute_score``).

The demo (:mod:`verl_group_ppo.demo`) trains on this task; the CPU backend (:mod:`verl_group_ppo.cpu`) knows
nothing of it.
"""
