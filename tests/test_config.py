"""GroupParams: the documented defaults (docs/configuration.md), construction from dicts and OmegaConf, validation naming the key."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_group_ppo.config import V1_GROUP_PARAMS, GroupParams, read_algorithm_settings, select

SPEC_DEFAULTS = {
    "group_variance_threshold": 1.0, "group_max_size": 16, "group_epsilon": 1e-6, "adaptive_threshold": True,
    "threshold_lr": 0.01, "min_threshold": 0.1, "max_threshold": 10.0, "boundary_rule": "variance",
    "low_prob_threshold": 0.9, "adv_norm": "batch", "target_explained_variance": 0.5,
    "critic_loss_on": "boundaries",
}
V2_KEYS_AT_V1 = {"policy_lam": None, "critic_lam": None, "adaptive_target": "explained_variance",
                 "target_group_size": 8.0}
# docs/results.md, "Version 2": the defaults chosen from the three-seed comparison
V2_CHOSEN = {"threshold_lr": 0.1, "policy_lam": 0.95, "adaptive_target": "group_size", "target_group_size": 4.0}
# version 3 (SAE's per-token estimator as a setting): off by default, so every earlier result stands
V3_KEYS = {"within_group": "broadcast"}
# issue 26 (the endpoint-only policy loss, VAPO's length-adaptive lambda): off by default
POLICY_SIDE_KEYS = {"policy_loss_on": "all_tokens", "length_adaptive_alpha": None}
# value sources without a critic: off by default (the critic's values), so every earlier result stands
VALUE_SOURCE_KEYS = {"value_source": "critic", "mc_samples": 4}


def test_defaults_are_the_version_2_choice_and_every_key_has_help():
    assert GroupParams().to_dict() == {**SPEC_DEFAULTS, **V2_KEYS_AT_V1, **V2_CHOSEN, **V3_KEYS, **POLICY_SIDE_KEYS,
                                       **VALUE_SOURCE_KEYS}
    assert set(GroupParams.help()) == (set(SPEC_DEFAULTS) | set(V2_KEYS_AT_V1) | set(V3_KEYS)
                                       | set(POLICY_SIDE_KEYS) | set(VALUE_SOURCE_KEYS))
    assert all(GroupParams.help().values())


def test_v1_values_reproduce_the_version_1_configuration():
    assert GroupParams(**V1_GROUP_PARAMS).to_dict() == {**SPEC_DEFAULTS, **V2_KEYS_AT_V1, **V3_KEYS,
                                                        **POLICY_SIDE_KEYS, **VALUE_SOURCE_KEYS}
    overrides = {f"{k}": ("null" if v is None else str(v)) for k, v in V1_GROUP_PARAMS.items()}
    assert GroupParams.from_config(overrides) == GroupParams(**V1_GROUP_PARAMS)  # as command-line strings


def test_from_none_dict_and_omegaconf():
    assert GroupParams.from_config(None) == GroupParams()
    p = GroupParams.from_config({"group_max_size": 4, "adv_norm": "prompt"})
    assert p.group_max_size == 4 and p.adv_norm == "prompt" and p.threshold_lr == GroupParams().threshold_lr
    assert GroupParams.from_config(OmegaConf.create({"group_max_size": 4, "adv_norm": "prompt"})) == p
    assert GroupParams.from_config(p) is p
    assert GroupParams.from_config(p.to_dict()) == p


def test_values_as_yaml_and_command_lines_give_them():
    p = GroupParams.from_config({"group_max_size": 8.0, "group_variance_threshold": "inf", "adaptive_threshold": "false",
                                 "threshold_lr": 1})
    assert p.group_max_size == 8 and math.isinf(p.group_variance_threshold) and p.adaptive_threshold is False
    assert isinstance(p.threshold_lr, float)


@pytest.mark.parametrize("key, value", [
    ("group_max_size", 0), ("group_max_size", 2.5), ("group_max_size", True), ("group_variance_threshold", -0.1),
    ("group_variance_threshold", "lots"), ("group_epsilon", 0.0), ("threshold_lr", -1.0), ("min_threshold", -1.0),
    ("max_threshold", -1.0), ("low_prob_threshold", 1.5), ("target_explained_variance", 2.0),
    ("adaptive_threshold", "maybe"), ("boundary_rule", "entropy"), ("adv_norm", "group"),
    ("critic_loss_on", "everywhere"), ("groupmax_size", 4), ("policy_lam", 1.5), ("critic_lam", -0.1),
    ("critic_lam", "high"), ("adaptive_target", "reward"), ("target_group_size", 0.0), ("within_group", "mean"),
    ("target_group_size", float("inf")), ("policy_loss_on", "groups"), ("length_adaptive_alpha", 0.0),
    ("length_adaptive_alpha", -0.05), ("length_adaptive_alpha", "inf"), ("length_adaptive_alpha", "some"),
    ("length_adaptive_alpha", True),
])
def test_bad_value_names_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        GroupParams.from_config({key: value})


@pytest.mark.parametrize("key, value", [("group_max_size", 0), ("critic_lam", 2.0), ("adv_norm", "x")])
def test_errors_name_the_full_config_path(key, value):
    with pytest.raises(ValueError, match=rf"algorithm\.group_params\.{key}"):
        GroupParams.from_config({key: value})
    with pytest.raises(ValueError, match=r"algorithm\.lam"):
        read_algorithm_settings({"lam": 1.5})


def test_decoupled_lambdas_resolve_to_algorithm_lam_when_null():
    s = read_algorithm_settings({"lam": 0.95, "group_params": {"critic_lam": "null"}})
    assert (s.policy_lam, s.critic_lam) == (0.95, 0.95)
    s = read_algorithm_settings({"lam": 0.95, "group_params": {"policy_lam": 0.9, "critic_lam": 1}})
    assert (s.policy_lam, s.critic_lam) == (0.9, 1.0) and isinstance(s.group.critic_lam, float)


def test_select_reads_dotted_keys_from_every_config_kind():
    from verl.trainer.config import AlgoConfig

    node = OmegaConf.create({"algorithm": {"lam": 0.5}, "critic": {"enable": None}})
    assert select(node, "algorithm.lam") == 0.5 and select({"a": {"b": 2}}, "a.b") == 2
    assert select(node, "critic.enable", "dflt") == "dflt" and select(node, "x.y.z") is None
    assert select({"algorithm": AlgoConfig(gamma=0.9)}, "algorithm.gamma") == 0.9


def test_threshold_range_checks():
    with pytest.raises(ValueError, match="min_threshold"):
        GroupParams(min_threshold=2.0, max_threshold=1.0)
    with pytest.raises(ValueError, match="group_variance_threshold"):
        GroupParams(group_variance_threshold=20.0)  # outside [0.1, 10] with adaptation on
    assert GroupParams(group_variance_threshold=20.0, adaptive_threshold=False).group_variance_threshold == 20.0
    assert GroupParams(group_variance_threshold=0.0, boundary_rule="fixed").boundary_rule == "fixed"


def test_group_params_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupParams().group_max_size = 3  # type: ignore[misc]


def test_read_algorithm_settings():
    s = read_algorithm_settings({"gamma": 0.9, "lam": "0.5", "norm_adv_by_std_in_grpo": False,
                                 "group_params": {"group_max_size": 2}})
    assert (s.gamma, s.lam, s.norm_adv_by_std_in_grpo, s.group.group_max_size) == (0.9, 0.5, False, 2)
    assert read_algorithm_settings(None).gamma == 1.0
    with pytest.raises(ValueError, match="gamma"):
        read_algorithm_settings({"gamma": 2.0})
    with pytest.raises(ValueError, match="group_params"):
        read_algorithm_settings({"group_params": [1, 2]})


def test_default_lambdas_bootstrap_the_policy_and_keep_the_critic_on_algorithm_lam():
    """Version 2's defaults: policy_lam 0.95 whatever algorithm.lam says; critic_lam null follows algorithm.lam."""
    s = read_algorithm_settings({"lam": 1.0})
    assert (s.policy_lam, s.critic_lam) == (0.95, 1.0)
    s = read_algorithm_settings({"lam": 0.9, "group_params": {"policy_lam": None}})
    assert (s.policy_lam, s.critic_lam) == (0.9, 0.9)


REPO = Path(__file__).resolve().parents[1]
PACKAGED_YAML = REPO / "verl_group_ppo" / "configs" / "group_ppo_trainer.yaml"
CONFIGURATION_DOC = REPO / "docs" / "configuration.md"
# a row of a markdown table whose first cell is a key in backticks: | `key` | default cell | ...
TABLE_ROW = re.compile(r"^\|\s*`(?:algorithm\.group_params\.)?(\w+)`\s*\|([^|]*)\|")


def test_packaged_yaml_holds_every_group_param_at_its_default():
    group_params = OmegaConf.load(PACKAGED_YAML).algorithm.group_params
    assert set(group_params) == {f.name for f in dataclasses.fields(GroupParams)}
    assert GroupParams.from_config(group_params) == GroupParams()


def documented_defaults(markdown: str) -> dict[str, str]:
    """``key -> the first backticked value of its default cell`` for the table rows naming a GroupParams key."""
    keys = {f.name for f in dataclasses.fields(GroupParams)}
    found: dict[str, str] = {}
    for line in markdown.splitlines():
        match = TABLE_ROW.match(line)
        if match and match.group(1) in keys:
            value = re.search(r"`([^`]*)`", match.group(2))
            assert value, f"docs/configuration.md: the default of {match.group(1)} is not in backticks: {line}"
            assert match.group(1) not in found, f"docs/configuration.md: {match.group(1)} has two table rows"
            found[match.group(1)] = value.group(1)
    return found


def test_documented_defaults_table_parser():
    doc = "| key | default |\n|---|---|\n| `group_max_size` | `16` (x: `32`) | n |\n| `other` | `1` | n |\n"
    assert documented_defaults(doc) == {"group_max_size": "16"}


def test_documented_defaults_are_group_params_defaults():
    documented = documented_defaults(CONFIGURATION_DOC.read_text())
    assert set(documented) == {f.name for f in dataclasses.fields(GroupParams)}
    assert GroupParams.from_config(documented) == GroupParams()


def test_policy_side_keys_accept_their_values_and_reject_the_bad_combination():
    p = GroupParams.from_config({"policy_loss_on": "endpoints", "length_adaptive_alpha": "0.05"})
    assert p.policy_loss_on == "endpoints" and p.length_adaptive_alpha == 0.05
    assert GroupParams.from_config({"length_adaptive_alpha": "null"}).length_adaptive_alpha is None
    with pytest.raises(ValueError, match=r"algorithm\.group_params\.policy_loss_on.*within_group"):
        GroupParams.from_config({"policy_loss_on": "endpoints", "within_group": "per_token"})


# ----------------------------------------------------------------------------------------------------
# value sources


def test_boundary_rule_null_takes_the_value_sources_default():
    from verl_group_ppo.config import DEFAULT_BOUNDARY_RULE

    for source, rule in DEFAULT_BOUNDARY_RULE.items():
        assert GroupParams(value_source=source).boundary_rule == rule
        assert GroupParams.from_config({"value_source": source, "boundary_rule": "null"}).boundary_rule == rule
    assert GroupParams(value_source="mc", boundary_rule="low_prob").boundary_rule == "low_prob"
    assert GroupParams().boundary_rule == "variance"  # the critic's default is unchanged
    p = GroupParams(value_source="prefix_tree", mc_samples=2)
    assert GroupParams.from_config(p.to_dict()) == p


@pytest.mark.parametrize("settings,keys", [
    ({"value_source": "mc", "boundary_rule": "variance"}, ("boundary_rule", "value_source")),
    ({"value_source": "mc", "within_group": "per_token"}, ("within_group", "value_source")),
    ({"value_source": "mc", "policy_loss_on": "endpoints"}, ("policy_loss_on", "value_source")),
    ({"value_source": "mc", "critic_lam": 0.5}, ("critic_lam", "value_source")),
    ({"value_source": "prefix_tree", "critic_lam": 1.0}, ("critic_lam", "value_source")),
    ({"value_source": "prefix_tree", "critic_loss_on": "all_tokens"}, ("critic_loss_on", "value_source")),
    ({"value_source": "value_net"}, ("value_source",)),
    ({"mc_samples": 0}, ("mc_samples",)),
    ({"mc_samples": 2.5}, ("mc_samples",)),
    ({"mc_samples": True}, ("mc_samples",)),
])
def test_value_source_combinations_that_mean_nothing_are_refused_naming_the_keys(settings, keys):
    with pytest.raises(ValueError) as err:
        GroupParams.from_config(settings)
    for key in keys:
        assert f"algorithm.group_params.{key}" in str(err.value), str(err.value)


def test_prefix_tree_keeps_the_rules_that_read_values_at_every_token():
    # the tree has a value at every position, so the variance rule and per-token advantages have their meaning
    assert GroupParams(value_source="prefix_tree", boundary_rule="variance").boundary_rule == "variance"
    assert GroupParams(value_source="prefix_tree", within_group="per_token").within_group == "per_token"
    assert not GroupParams(value_source="prefix_tree").uses_critic and GroupParams().uses_critic
