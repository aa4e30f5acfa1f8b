"""GROUP-PPO configuration: the ``algorithm.group_params`` keys and the algorithm settings they sit beside.

verl hands an advantage estimator its ``algorithm`` config (a DictConfig in the v1 trainer, sometimes the
``AlgoConfig`` dataclass or a plain dict in user code). :func:`read_algorithm_settings` reads the three
algorithm keys GROUP-PPO uses (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``) and its ``group_params``
from any of those, filling missing keys with defaults and naming the offending key on bad values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

BOUNDARY_RULES = ("variance", "fixed", "low_prob")
ADV_NORMS = ("batch", "prompt", "none")
CRITIC_LOSS_ON = ("boundaries", "all_tokens")


def _help(text: str, default: Any) -> Any:
    """A dataclass field with a default and a one-line help text in its metadata."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class GroupParams:
    """``algorithm.group_params``: how responses are cut into groups and how the critic is used.

    Names and defaults follow the GROUP-PPO spec's Defaults section. Build it with :meth:`from_config`,
    which validates every key; constructing it directly validates too.
    """

    group_variance_threshold: float = _help(
        "Starting (or, with adaptation off, fixed) variance budget tau: 0 = every token a group (PPO), "
        "inf = groups as long as group_max_size allows.", 1.0)
    group_max_size: int = _help("Most valid tokens in one group (>= 1); 1 reproduces token-level GAE.", 16)
    group_epsilon: float = _help("Small positive constant in the normalised TD variance and explained variance.", 1e-6)
    adaptive_threshold: bool = _help("Adapt tau each batch from the critic's boundary explained variance.", True)
    threshold_lr: float = _help("Step size of the multiplicative tau update (log-space).", 0.01)
    min_threshold: float = _help("Lower bound for the adapted tau.", 0.1)
    max_threshold: float = _help("Upper bound for the adapted tau.", 10.0)
    boundary_rule: str = _help("Endpoint rule: 'variance' (TD-variance budget), 'fixed' or 'low_prob'.", "variance")
    low_prob_threshold: float = _help("low_prob rule: a new group starts at a token with old prob below this.", 0.9)
    adv_norm: str = _help("Advantage normalisation: 'batch' (verl masked_whiten), 'prompt' (per uid) or 'none'.",
                          "batch")
    target_explained_variance: float = _help("Boundary explained variance the adaptive tau steers toward.", 0.5)
    critic_loss_on: str = _help("Critic loss at 'boundaries' (value slots the advantages use) or 'all_tokens'.",
                                "boundaries")

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_config(cls, obj: Any = None) -> "GroupParams":
        """Build from None (defaults), a GroupParams, a mapping or an OmegaConf node.

        Missing keys take their defaults; an unknown key or a bad value raises ValueError naming it.
        """
        if obj is None:
            return cls()
        if isinstance(obj, GroupParams):
            return obj
        raw = _to_plain_dict(obj, "group_params")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"group_params: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**{key: _coerce(key, value) for key, value in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every key (for logging, checkpoints and OmegaConf)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def help() -> dict[str, str]:
        """One line of help per key."""
        return {f.name: f.metadata["help"] for f in fields(GroupParams)}


@dataclass(frozen=True)
class AlgorithmSettings:
    """The algorithm keys GROUP-PPO reads: discounting, lambda, GRPO-style std scaling, and group params."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    group: GroupParams = field(default_factory=GroupParams)

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def read_algorithm_settings(config: Any = None) -> AlgorithmSettings:
    """Read ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo`` and ``group_params`` from verl's algorithm config.

    Args:
        config: None, a mapping, an OmegaConf DictConfig, or an object with those attributes
            (verl's ``AlgoConfig``). Missing keys take defaults (gamma=1, lam=1, as in verl's AlgoConfig).
    """
    if config is None:
        return AlgorithmSettings()
    if isinstance(config, AlgorithmSettings):
        return config
    getter = _getter(config)
    group = GroupParams.from_config(getter("group_params"))
    settings = {}
    for name in ("gamma", "lam"):
        value = getter(name)
        if value is not None:
            settings[name] = _coerce_float(name, value)
    norm = getter("norm_adv_by_std_in_grpo")
    if norm is not None:
        settings["norm_adv_by_std_in_grpo"] = _coerce_bool("norm_adv_by_std_in_grpo", norm)
    return AlgorithmSettings(group=group, **settings)


# --------------------------------------------------------------------------------------------------
# helpers


def _validate(p: GroupParams) -> None:
    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"group_params.{key} {why}, got {getattr(p, key)!r}")

    if isinstance(p.group_max_size, bool) or not isinstance(p.group_max_size, int) or p.group_max_size < 1:
        raise bad("group_max_size", "must be an integer >= 1")
    for key in ("group_variance_threshold", "group_epsilon", "threshold_lr", "min_threshold", "max_threshold",
                "low_prob_threshold", "target_explained_variance"):
        value = getattr(p, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise bad(key, "must be a number")
    if p.group_variance_threshold < 0:
        raise bad("group_variance_threshold", "must be >= 0 (0 = token-level groups)")
    if not (p.group_epsilon > 0 and math.isfinite(p.group_epsilon)):
        raise bad("group_epsilon", "must be a finite number > 0")
    if not (p.threshold_lr >= 0 and math.isfinite(p.threshold_lr)):
        raise bad("threshold_lr", "must be a finite number >= 0")
    if p.min_threshold < 0:
        raise bad("min_threshold", "must be >= 0")
    if p.max_threshold < 0:
        raise bad("max_threshold", "must be >= 0")
    if p.min_threshold > p.max_threshold:
        raise ValueError(f"group_params.min_threshold ({p.min_threshold}) must not exceed "
                         f"group_params.max_threshold ({p.max_threshold})")
    if not 0.0 <= p.low_prob_threshold <= 1.0:
        raise bad("low_prob_threshold", "must be in [0, 1]")
    if not -1.0 <= p.target_explained_variance <= 1.0:
        raise bad("target_explained_variance", "must be in [-1, 1]")
    if not isinstance(p.adaptive_threshold, bool):
        raise bad("adaptive_threshold", "must be true or false")
    for key, choices in (("boundary_rule", BOUNDARY_RULES), ("adv_norm", ADV_NORMS),
                         ("critic_loss_on", CRITIC_LOSS_ON)):
        if getattr(p, key) not in choices:
            raise bad(key, f"must be one of {list(choices)}")
    if (p.adaptive_threshold and p.boundary_rule == "variance"
            and not p.min_threshold <= p.group_variance_threshold <= p.max_threshold):
        raise ValueError(
            f"group_params.group_variance_threshold ({p.group_variance_threshold}) must lie in "
            f"[min_threshold, max_threshold] = [{p.min_threshold}, {p.max_threshold}] when adaptive_threshold "
            "is true (set adaptive_threshold=false to use a threshold outside that range)")


_FIELD_TYPES = {f.name: f.type for f in fields(GroupParams)}


def _coerce(key: str, value: Any) -> Any:
    """Accept what YAML/Hydra/JSON produce for a key (e.g. 8.0 for 8, 'inf' for inf), reject the rest."""
    kind = _FIELD_TYPES[key]
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("+").isdigit():
            return int(value)
        return value  # validated (and rejected if wrong) in _validate
    if kind == "float":
        return _coerce_float(f"group_params.{key}", value)
    if kind == "bool":
        return _coerce_bool(f"group_params.{key}", value)
    return value


def _coerce_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{name} must be a number, got {value!r}")


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _to_plain_dict(obj: Any, name: str) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf node (resolving interpolations)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        DictConfig = ()  # type: ignore[assignment]
    if DictConfig and isinstance(obj, DictConfig):
        return dict(OmegaConf.to_container(obj, resolve=True))  # type: ignore[arg-type]
    if isinstance(obj, Mapping):
        return dict(obj)
    raise ValueError(f"{name} must be a mapping (dict or DictConfig), got {type(obj).__name__}")


def _getter(config: Any):
    """A ``get(key)`` over a mapping/DictConfig or an attribute object, returning None when absent."""
    if isinstance(config, Mapping) or hasattr(config, "get") and not hasattr(config, "__dataclass_fields__"):
        return lambda key: config.get(key, None)
    return lambda key: getattr(config, key, None)
