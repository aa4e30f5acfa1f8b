"""Input validation of the estimator: each bad input gets a ValueError naming the argument.

Conventions as in :mod:`verl_group_ppo.core_algos`: tensors (B, T), masks 0/1.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

__all__ = ["IndexLike", "check_finite_at_valid", "check_float", "check_mask", "check_parent_nodes", "describe",
           "prompt_ids"]

IndexLike = Union[np.ndarray, Sequence[Any], torch.Tensor]


def check_mask(mask: Any, name: str) -> torch.Tensor:
    """The mask as bool, after checking it holds only 0 and 1."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (B, T), got {describe(mask)}")
    if mask.dtype == torch.bool:
        return mask
    valid = mask != 0
    # every nonzero entry is 1 when the ones are as many as the nonzeros (a NaN is nonzero and not 1)
    if mask.is_complex() or int(torch.count_nonzero(mask == 1)) != int(torch.count_nonzero(valid)):
        raise ValueError(f"{name} must contain only 0 and 1")
    return valid


def check_float(x: Any, name: str, shape: tuple, device: torch.device) -> None:
    """ValueError naming ``name`` unless ``x`` is a floating-point tensor of ``shape`` on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {describe(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (that of response_mask), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but response_mask is on {device}")


def check_finite_at_valid(x: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` when ``x`` (B, T), 0 at masked positions, holds a NaN or inf (so at a valid one)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite at valid positions of response_mask (found NaN or inf)")


def prompt_ids(index: IndexLike, batch_size: int) -> np.ndarray:
    """verl's ``index`` (``uid``: strings, ints, or a tensor) as (B,) int64 prompt ids 0..P-1, in sorted order of the
    ids; ValueError naming ``index`` when it is not ``batch_size`` comparable ids."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    arr = np.asarray(index)
    if arr.ndim != 1 or len(arr) != batch_size:
        raise ValueError(f"index must be a 1-D sequence of {batch_size} prompt ids (one per response), "
                         f"got shape {arr.shape}")
    try:
        _, inverse = np.unique(arr, return_inverse=True)
    except TypeError as err:
        raise ValueError(f"index must hold comparable prompt ids (all str or all int): {err}") from None
    return inverse.reshape(-1).astype(np.int64)


def describe(x: Any) -> str:
    """A short description of ``x`` for error messages: a tensor's shape and dtype, else its type's name."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def check_parent_nodes(parent_nodes: Any, valid: torch.Tensor, adv_norm: str) -> Optional[torch.Tensor]:
    """``parent_nodes`` (B, T) integer on ``valid``'s device under ``adv_norm='parent'``, None otherwise; a ValueError
    names it when it is missing, misshapen, not integer, or given to another normalisation."""
    if adv_norm != "parent":
        if parent_nodes is not None:
            raise ValueError(f"parent_nodes is read only by adv_norm='parent', and adv_norm={adv_norm!r}")
        return None
    if parent_nodes is None:
        raise ValueError("parent_nodes is required by adv_norm='parent' (the tree node each group hangs from, which "
                         "the prefix_tree value source finds: verl_group_ppo.values.boundary_values)")
    shape = tuple(valid.shape)
    if (not isinstance(parent_nodes, torch.Tensor) or tuple(parent_nodes.shape) != shape
            or parent_nodes.dtype.is_floating_point or parent_nodes.dtype == torch.bool):
        raise ValueError(f"parent_nodes must be an integer (B, T) tensor of the shape of response_mask {shape}, "
                         f"got {describe(parent_nodes)}")
    return parent_nodes.to(device=valid.device, dtype=torch.long)
