"""Loop twins of the value sources (:mod:`verl_group_ppo.value_sources`), for tests only. The estimator's loop
reference is in the package: :mod:`verl_group_ppo.estimator.reference`."""

__all__ = ["loop_mc_boundary_values", "loop_prefix_tree_values"]


def loop_prefix_tree_values(ids, attention, scores, index):
    """V[b][t] = mean score of the replies of b's prompt whose positions 0..t-1 equal b's (token and existence)."""
    B, T = len(ids), len(ids[0])
    values = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            sharing = [j for j in range(B) if index[j] == index[b]
                       and all(ids[j][p] == ids[b][p] and attention[j][p] == attention[b][p] for p in range(t))]
            values[b][t] = sum(scores[j] for j in sharing) / len(sharing)
    return values


def loop_mc_boundary_values(starts, continuation_scores, scores, index):
    """V[b][t] at each group start: the prompt's mean score at t = 0, else the mean of that start's K continuation
    scores (one row per start after position 0, row by row, left to right); 0 elsewhere."""
    B, T = len(starts), len(starts[0])
    values = [[0.0] * T for _ in range(B)]
    row = 0
    for b in range(B):
        for t in range(T):
            if not starts[b][t]:
                continue
            if t == 0:
                mine = [scores[j] for j in range(B) if index[j] == index[b]]
                values[b][t] = sum(mine) / len(mine)
            else:
                values[b][t] = sum(continuation_scores[row]) / len(continuation_scores[row])
                row += 1
    return values
