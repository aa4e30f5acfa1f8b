"""``{step}.groups.jsonl``: the groups of a real run, written beside verl's rollout dump.

With ``trainer.rollout_data_dir`` set, verl's v1 trainer writes ``{rollout_data_dir}/{global_step}.jsonl``
every step (``PPOTrainer.fit`` calls ``_log_rollout_data``; the file name is built in
``_write_generations``, both in ``verl.trainer.ppo.v1.trainer_base``). For ``group_ppo`` runs the trainer
also writes ``{global_step}.groups.jsonl`` in the same folder: one JSON object per response, over its valid
response tokens (``response_mask`` as the estimator saw it)::

    {"step": int, "uid": str, "score": float, "tokens": [str], "group_ids": [int],
     "advantages": [float], "endpoints": [0/1], "row": {...}}

``uid`` is the prompt id (verl's ``uid`` field; responses to one prompt share it), ``score`` the sum of
the response's ``rm_scores`` (as verl's dump), ``tokens`` each token id decoded alone by the trainer's
tokenizer, ``group_ids`` the 1-based group of each token within its response, ``endpoints`` 1 at
each group's last token, 0 elsewhere. ``python -m verl_group_ppo.viz`` reads this format.

``row`` holds the estimator's inputs and outputs over the response's positions up to its last valid token,
masked positions included (a multi-turn response's tool replies): ``response_ids``, ``response_mask``,
``token_level_rewards``, ``values``, ``advantages``, ``returns`` and ``critic_mask``, and the ``threshold`` tau
the batch was cut with. With it a step's file is the whole advantage step of that batch, as verl produced it
(the multi-turn tests read such a file).

With the tree rollout (``tree_single_turn``) each record also has ``"tree": {"parent": int, "branch_position":
int, "level": int}``: the sample it branched from (-1 for a root), the reply tokens it copied from it, and its
branch level (0 for a root), from the row's ``extra_fields``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import torch

from verl_group_ppo.files import write_file

GROUPS_FILE_SUFFIX = ".groups.jsonl"


def groups_file(rollout_data_dir: str, global_step: int) -> str:
    """The path of step ``global_step``'s groups file (verl's dump is ``{global_step}.jsonl`` there)."""
    return os.path.join(rollout_data_dir, f"{global_step}{GROUPS_FILE_SUFFIX}")


def response_records(step: int, uids: Sequence[str], scores: torch.Tensor, responses: torch.Tensor,
                     response_mask: torch.Tensor, outputs: Any, tokenizer: Any, rewards: torch.Tensor,
                     values: torch.Tensor, tree: Optional[Sequence[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """One record per response (see the module docstring).

    Args:
        step: verl's global step.
        uids: (B,) prompt ids.
        scores: (B,) the responses' scores.
        responses: (B, T) token ids, right-padded like ``response_mask``.
        response_mask: (B, T) 0/1, the mask the estimator saw.
        outputs: the estimator's ``GroupPPOOutputs`` for this batch ((B, T) ``group_ids``, ``advantages``,
            ``endpoint_mask``, ``returns``, ``critic_mask``).
        tokenizer: has ``batch_decode(list of id lists) -> list[str]`` (a Hugging Face tokenizer).
        rewards, values: (B, T) the estimator's ``token_level_rewards`` and ``values``.
        tree: (B,) each row's ``extra_fields`` when the tree rollout made the rows (:func:`tree_position`), else None.
    """
    records = []
    for i, uid in enumerate(uids):
        valid = response_mask[i].bool()
        ids = responses[i][valid].tolist()
        span = int(valid.nonzero().max()) + 1 if ids else 0
        row = {"threshold": float(outputs.threshold), "response_ids": responses[i, :span].tolist(),
               "response_mask": response_mask[i, :span].int().tolist()}
        for name, value in (("token_level_rewards", rewards), ("values", values), ("advantages", outputs.advantages),
                            ("returns", outputs.returns), ("critic_mask", outputs.critic_mask)):
            row[name] = value[i, :span].float().tolist()
        records.append({
            "step": int(step),
            "uid": str(uid),
            "score": float(scores[i]),
            "tokens": list(tokenizer.batch_decode([[token] for token in ids])) if ids else [],
            "group_ids": outputs.group_ids[i][valid].tolist(),
            "advantages": outputs.advantages[i][valid].float().tolist(),
            "endpoints": outputs.endpoint_mask[i][valid].int().tolist(),
            "row": row,
            **({"tree": tree_position(tree[i])} if tree is not None else {}),
        })
    return records


def tree_position(extra_fields: dict[str, Any]) -> dict[str, int]:
    """A tree row's place, from its ``extra_fields``: ``parent``, ``branch_position`` and ``level``."""
    return {"parent": int(extra_fields["tree_parent"]), "branch_position": int(extra_fields["tree_branch_position"]),
            "level": int(extra_fields["tree_level"])}


def write_records(path: str, records: Sequence[dict[str, Any]]) -> str:
    """Write ``records`` as JSON lines to ``path`` (folder created; written whole, then renamed)."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    return write_file(path, write)
