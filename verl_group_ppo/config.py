"""GROUP-PPO configuration: the ``algorithm.group_params`` keys, the algorithm settings beside them, and the
project's one config reader and one set of validators.

verl hands an advantage estimator its ``algorithm`` config (a DictConfig in the v1 trainer, sometimes the
``AlgoConfig`` dataclass or a plain dict in user code). :func:`read_algorithm_settings` reads the algorithm
keys GROUP-PPO uses (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``) and its ``group_params`` from any of
those into a typed :class:`AlgorithmSettings`; :func:`select` reads any other dotted key of a verl config.
Bad values raise ValueError naming the key by its full path (``algorithm.group_params.group_max_size``).
The keys and what they do: docs/configuration.md; the algorithm they drive: docs/algorithm.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

BOUNDARY_RULES = ("variance", "fixed", "low_prob", "turn", "tree")
VALUE_SOURCES = ("critic", "mc", "prefix_tree")
DEFAULT_BOUNDARY_RULE = {"critic": "variance", "mc": "fixed", "prefix_tree": "fixed"}
"""The boundary rule each value source takes when ``boundary_rule`` is null (docs/algorithm.md, "Value sources")."""
ADV_NORMS = ("batch", "prompt", "parent", "none")
CRITIC_LOSS_ON = ("boundaries", "all_tokens")
ADAPTIVE_TARGETS = ("explained_variance", "group_size")
WITHIN_GROUP = ("broadcast", "per_token")
POLICY_LOSS_ON = ("all_tokens", "endpoints")

GROUP_PARAMS_PATH = "algorithm.group_params"
"""Where the group parameters live in verl's config (error messages name keys by this full path)."""


def _help(text: str, default: Any) -> Any:
    """A dataclass field with a default and a one-line help text in its metadata."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class GroupParams:
    """``algorithm.group_params``: how responses are cut into groups and how the critic is used.

    Build it with :meth:`from_config`, which converts YAML/command-line values; constructing it directly
    validates too. Every field's one-line help is in ``GroupParams.help()``.
    """

    group_variance_threshold: float = _help(
        "Starting (or, with adaptation off, fixed) variance budget tau: 0 = every token a group (PPO), "
        "inf = groups as long as group_max_size allows.", 1.0)
    group_max_size: int = _help(
        "Most valid tokens in one group (>= 1) under every rule but 'turn'; 1 reproduces token-level GAE.", 16)
    group_epsilon: float = _help("Small positive constant in the normalised TD variance and explained variance.", 1e-6)
    adaptive_threshold: bool = _help("Adapt tau after each batch toward adaptive_target (variance rule only).", True)
    threshold_lr: float = _help("Step size of the multiplicative tau update (log-space).", 0.1)
    min_threshold: float = _help("Lower bound for the adapted tau.", 0.1)
    max_threshold: float = _help("Upper bound for the adapted tau.", 10.0)
    boundary_rule: Optional[str] = _help(
        "Endpoint rule: 'variance' (TD-variance budget), 'fixed', 'low_prob', 'turn' (one group per turn, "
        "group_max_size unused; turns capped at N tokens: 'fixed' with group_max_size N) or 'tree' (the tree "
        "rollout's segments: groups end at each row's branch points, group_max_size unused; value_source "
        "prefix_tree only); null = the value source's default (DEFAULT_BOUNDARY_RULE).", None)
    low_prob_threshold: float = _help("low_prob rule: a new group starts at a token with old prob below this.", 0.9)
    adv_norm: str = _help("Advantage normalisation: 'batch' (verl masked_whiten), 'prompt' (per uid), 'parent' (per "
                          "tree node, over the segments that hang from it; boundary_rule tree only) or 'none'.",
                          "batch")
    target_explained_variance: float = _help(
        "adaptive_target=explained_variance: the boundary explained variance tau steers toward.", 0.5)
    critic_loss_on: str = _help("Critic loss at 'boundaries' (value slots the advantages use) or 'all_tokens'.",
                                "boundaries")
    policy_lam: Optional[float] = _help(
        "Lambda of the advantages' segment GAE, in [0, 1]; null = algorithm.lam.", 0.95)
    critic_lam: Optional[float] = _help(
        "Lambda of the critic's returns (its targets), in [0, 1]; null = algorithm.lam.", None)
    adaptive_target: str = _help(
        "What tau adapts to: 'group_size' or 'explained_variance' (v1; can run away, see docs).",
        "group_size")
    target_group_size: float = _help(
        "adaptive_target=group_size: the mean valid tokens per group tau steers toward (> 0).", 4.0)
    within_group: str = _help(
        "Advantages inside a group: 'broadcast' (one per group) or 'per_token' (SAE-style, own baseline).",
        "broadcast")
    policy_loss_on: str = _help(
        "Actor loss on 'all_tokens' or 'endpoints' (token-level GAE kept at group endpoints, x N_valid/N_endpoints).",
        "all_tokens")
    length_adaptive_alpha: Optional[float] = _help(
        "VAPO's length-adaptive policy lambda 1 - 1/(alpha * L) per response (L valid tokens); null = off.", None)
    value_source: str = _help(
        "Values at group boundaries: 'critic' (verl's critic), 'mc' (mean reward of mc_samples continuations "
        "from each boundary) or 'prefix_tree' (mean reward of the prompt's replies sharing the prefix); "
        "the last two run no critic.", "critic")
    mc_samples: int = _help("value_source=mc: continuations sampled from each group boundary (K >= 1).", 4)

    def __post_init__(self) -> None:
        if self.boundary_rule is None and self.value_source in DEFAULT_BOUNDARY_RULE:
            object.__setattr__(self, "boundary_rule", DEFAULT_BOUNDARY_RULE[self.value_source])
        _validate(self)

    @property
    def uses_critic(self) -> bool:
        """True when the boundary values come from verl's critic (``value_source: critic``)."""
        return self.value_source == "critic"

    @classmethod
    def from_config(cls, obj: Any = None) -> "GroupParams":
        """Build from None (defaults), a GroupParams, a mapping or an OmegaConf node.

        Missing keys take their defaults; an unknown key or a bad value raises ValueError naming it.
        """
        if obj is None:
            return cls()
        if isinstance(obj, GroupParams):
            return obj
        raw = to_plain_dict(obj, GROUP_PARAMS_PATH)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{GROUP_PARAMS_PATH}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**{key: _coerce(key, value) for key, value in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every key (for logging, checkpoints and OmegaConf)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def help() -> dict[str, str]:
        """One line of help per key."""
        return {f.name: f.metadata["help"] for f in fields(GroupParams)}


#: The version-1 values of the keys whose defaults changed in version 2 (docs/results.md, "Version 2"):
#: ``GroupParams(**V1_GROUP_PARAMS)`` is the version-1 configuration; as Hydra overrides,
#: ``++algorithm.group_params.KEY=VALUE`` for each (with ``trainer.critic_warmup=0``).
V1_GROUP_PARAMS: dict[str, Any] = {"threshold_lr": 0.01, "policy_lam": None,
                                   "adaptive_target": "explained_variance", "target_group_size": 8.0}


@dataclass(frozen=True)
class AlgorithmSettings:
    """The algorithm keys GROUP-PPO reads: discounting, lambda, GRPO-style std scaling, and group params."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    group: GroupParams = field(default_factory=GroupParams)

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            check_unit_interval(getattr(self, name), f"algorithm.{name}")

    @property
    def policy_lam(self) -> float:
        """The lambda the advantages use: ``group_params.policy_lam``, else ``algorithm.lam`` (with
        ``group_params.length_adaptive_alpha`` set, each response's own lambda replaces it)."""
        return self.lam if self.group.policy_lam is None else self.group.policy_lam

    @property
    def critic_lam(self) -> float:
        """The lambda the critic's returns use: ``group_params.critic_lam``, else ``algorithm.lam``."""
        return self.lam if self.group.critic_lam is None else self.group.critic_lam


def read_algorithm_settings(config: Any = None) -> AlgorithmSettings:
    """Read ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo`` and ``group_params`` from verl's algorithm config.

    Args:
        config: None, an :class:`AlgorithmSettings`, a mapping, an OmegaConf DictConfig, or an object with
            those attributes (verl's ``AlgoConfig``). Missing keys take defaults (gamma=1, lam=1, as in
            verl's AlgoConfig).
    """
    if config is None:
        return AlgorithmSettings()
    if isinstance(config, AlgorithmSettings):
        return config
    group = GroupParams.from_config(select(config, "group_params"))
    settings: dict[str, Any] = {}
    for name in ("gamma", "lam"):
        value = select(config, name)
        if value is not None:
            settings[name] = _coerce_float(f"algorithm.{name}", value)
    norm = select(config, "norm_adv_by_std_in_grpo")
    if norm is not None:
        settings["norm_adv_by_std_in_grpo"] = _coerce_bool("algorithm.norm_adv_by_std_in_grpo", norm)
    return AlgorithmSettings(group=group, **settings)


def select(config: Any, dotted_key: str, default: Any = None) -> Any:
    """``config.a.b`` for a DictConfig, nested mappings or attribute objects (verl's config dataclasses).

    Returns ``default`` when a level is missing or the value is None.
    """
    node = config
    for part in dotted_key.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or (hasattr(node, "get") and not hasattr(node, "__dataclass_fields__")):
            node = node.get(part, None)
        else:
            node = getattr(node, part, None)
    return default if node is None else node


# --------------------------------------------------------------------------------------------------
# validators (the project's one set)


def check_unit_interval(value: Any, name: str) -> float:
    """``value`` as a float in [0, 1], else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_threshold(value: Any, name: str) -> float:
    """A variance threshold tau: a number >= 0 (inf allowed), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} (the variance threshold tau) must be a number >= 0, got {value!r}")
    return float(value)


def check_critic_loss_agg_mode(loss_agg_mode: Any) -> None:
    """The boundary critic loss (docs/algorithm.md, Step 7) is defined for verl's ``token-mean`` only."""
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"critic.loss_agg_mode={loss_agg_mode!r} is not supported with algorithm.adv_estimator=group_ppo and "
            f"{GROUP_PARAMS_PATH}.critic_loss_on=boundaries: the boundary weights N_valid/N_boundary assume verl's "
            "token-mean; set critic.loss_agg_mode=token-mean (in verl 0.9.1 it follows "
            "actor_rollout_ref.actor.loss_agg_mode unless set) or critic_loss_on=all_tokens.")


_NUMBER_KEYS = ("group_variance_threshold", "group_epsilon", "threshold_lr", "min_threshold", "max_threshold",
                "low_prob_threshold", "target_explained_variance", "target_group_size")
_CHOICES = (("value_source", VALUE_SOURCES), ("boundary_rule", BOUNDARY_RULES), ("adv_norm", ADV_NORMS),
            ("critic_loss_on", CRITIC_LOSS_ON), ("adaptive_target", ADAPTIVE_TARGETS), ("within_group", WITHIN_GROUP),
            ("policy_loss_on", POLICY_LOSS_ON))


def _bad(p: GroupParams, key: str, why: str) -> ValueError:
    return ValueError(f"{GROUP_PARAMS_PATH}.{key} {why}, got {getattr(p, key)!r}")


def _validate(p: GroupParams) -> None:
    """Every key's type and range; the cross-key rules in :func:`_validate_threshold_range`."""
    for key in ("group_max_size", "mc_samples"):
        value = getattr(p, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(p, key, "must be an integer >= 1")
    for key in _NUMBER_KEYS:
        value = getattr(p, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise _bad(p, key, "must be a number")
    check_threshold(p.group_variance_threshold, f"{GROUP_PARAMS_PATH}.group_variance_threshold")
    for key, ok, why in (
        ("group_epsilon", p.group_epsilon > 0 and math.isfinite(p.group_epsilon), "must be a finite number > 0"),
        ("threshold_lr", p.threshold_lr >= 0 and math.isfinite(p.threshold_lr), "must be a finite number >= 0"),
        ("min_threshold", p.min_threshold >= 0, "must be >= 0"),
        ("max_threshold", p.max_threshold >= 0, "must be >= 0"),
        ("low_prob_threshold", 0.0 <= p.low_prob_threshold <= 1.0, "must be in [0, 1]"),
        ("target_explained_variance", -1.0 <= p.target_explained_variance <= 1.0, "must be in [-1, 1]"),
        ("target_group_size", 0 < p.target_group_size < math.inf, "must be a finite number > 0"),
        ("adaptive_threshold", isinstance(p.adaptive_threshold, bool), "must be true or false"),
    ):
        if not ok:
            raise _bad(p, key, why)
    for key in ("policy_lam", "critic_lam"):
        if getattr(p, key) is not None:
            check_unit_interval(getattr(p, key), f"{GROUP_PARAMS_PATH}.{key} (or null for algorithm.lam)")
    for key, choices in _CHOICES:
        if getattr(p, key) not in choices:
            raise _bad(p, key, f"must be one of {list(choices)}")
    _validate_policy_loss(p)
    _validate_value_source(p)
    _validate_threshold_range(p)


#: What each value source cannot combine with: (key, its refused value or None for "any non-null value", why).
_NOT_WITH_SOURCE = {
    "mc": (("boundary_rule", "variance", "the variance rule reads values at every token, and mc values exist only "
            "at group boundaries (chosen before the continuations are sampled); use 'fixed', 'low_prob' or 'turn'"),
           ("within_group", "per_token", "per-token advantages need a value at every token; mc has them only at "
            "group boundaries"),
           ("policy_loss_on", "endpoints", "endpoint advantages are token-level GAE, which needs a value at every "
            "token; mc has them only at group boundaries")),
    "prefix_tree": (),
}
_CRITIC_ONLY = (("critic_lam", None, "it sets the critic's returns, and this value source trains no critic"),
                ("critic_loss_on", "all_tokens", "it sets the critic's loss, and this value source trains no critic"))


def _validate_value_source(p: GroupParams) -> None:
    """Refuse a key that means nothing with the value source, naming both keys."""
    if p.boundary_rule == "tree" and p.value_source != "prefix_tree":
        raise ValueError(f"{GROUP_PARAMS_PATH}.boundary_rule='tree' does not combine with {GROUP_PARAMS_PATH}."
                         f"value_source={p.value_source!r}: the tree's segments are the pieces on which the prefix "
                         "tree's value is constant; use value_source=prefix_tree (with the tree rollout)")
    if p.adv_norm == "parent":
        for key, needed in (("boundary_rule", "tree"), ("within_group", "broadcast"),
                            ("policy_loss_on", "all_tokens")):
            if getattr(p, key) != needed:
                raise ValueError(f"{GROUP_PARAMS_PATH}.adv_norm='parent' needs {GROUP_PARAMS_PATH}.{key}={needed!r} "
                                 f"(it normalises each tree segment's advantage with its siblings'), got "
                                 f"{getattr(p, key)!r}")
    if p.uses_critic:
        return
    for key, refused, why in _NOT_WITH_SOURCE[p.value_source] + _CRITIC_ONLY:
        value = getattr(p, key)
        if (refused is None and value is not None) or (refused is not None and value == refused):
            raise ValueError(f"{GROUP_PARAMS_PATH}.{key}={value!r} does not combine with "
                             f"{GROUP_PARAMS_PATH}.value_source={p.value_source!r}: {why}")


def _validate_policy_loss(p: GroupParams) -> None:
    """``length_adaptive_alpha``: null or a finite number > 0; ``policy_loss_on: endpoints`` uses token-level
    advantages, so it does not combine with ``within_group: per_token``."""
    alpha = p.length_adaptive_alpha
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0 < alpha < math.inf):
        raise _bad(p, "length_adaptive_alpha", "must be a finite number > 0 (or null for off)")
    if p.policy_loss_on == "endpoints" and p.within_group != "broadcast":
        raise ValueError(f"{GROUP_PARAMS_PATH}.policy_loss_on='endpoints' takes token-level GAE advantages and "
                         f"does not combine with {GROUP_PARAMS_PATH}.within_group={p.within_group!r}; "
                         "leave within_group at 'broadcast'")


def _validate_threshold_range(p: GroupParams) -> None:
    """min <= max, and with adaptation on (variance rule) the starting tau inside [min, max]."""
    if p.min_threshold > p.max_threshold:
        raise ValueError(f"{GROUP_PARAMS_PATH}.min_threshold ({p.min_threshold}) must not exceed "
                         f"{GROUP_PARAMS_PATH}.max_threshold ({p.max_threshold})")
    if (p.adaptive_threshold and p.boundary_rule == "variance"
            and not p.min_threshold <= p.group_variance_threshold <= p.max_threshold):
        raise ValueError(
            f"{GROUP_PARAMS_PATH}.group_variance_threshold ({p.group_variance_threshold}) must lie in "
            f"[min_threshold, max_threshold] = [{p.min_threshold}, {p.max_threshold}] when adaptive_threshold "
            "is true (set adaptive_threshold=false to use a threshold outside that range)")


_FIELD_TYPES = {f.name: f.type for f in fields(GroupParams)}


def _coerce(key: str, value: Any) -> Any:
    """Accept what YAML/Hydra/JSON produce for a key (e.g. 8.0 for 8, 'inf' for inf), reject the rest."""
    kind = _FIELD_TYPES[key]
    name = f"{GROUP_PARAMS_PATH}.{key}"
    if kind == "Optional[float]":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
            return None
        return _coerce_float(name, value)
    if kind == "Optional[str]":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
            return None
        return value
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("+").isdigit():
            return int(value)
        return value  # validated (and rejected if wrong) in _validate
    if kind == "float":
        return _coerce_float(name, value)
    if kind == "bool":
        return _coerce_bool(name, value)
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


def to_plain_dict(obj: Any, name: str) -> dict[str, Any]:
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
