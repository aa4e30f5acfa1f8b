"""The estimator's rooms: :mod:`~verl_group_ppo.estimator.reference` (steps 1-7 as plain loops, the oracle),
:mod:`~verl_group_ppo.estimator.fast` (the same steps vectorised over batch and time) and
:mod:`~verl_group_ppo.estimator.checks` (input validation). The public functions live in
:mod:`verl_group_ppo.core_algos`."""
