"""The estimator's outputs, pinned bit for bit on fixed inputs and a set of settings that covers every branch.

Inputs: the recorded real multi-turn step (``tests/data/multiturn_step2.groups.jsonl``, read as
``test_multiturn_masks`` reads it, with seeded old log-probs for the ``low_prob`` rule), and two batches of the
demo's RL loop on the tiny task at a fixed seed, stored in ``tests/data/estimator_pin_demo_batches.json``
(rewards, mask, values, old log-probs, prompt ids) so that the pins depend on the estimator alone.

Pins (``tests/data/estimator_pins.json``): per batch, settings and dtype, every tensor
:func:`~verl_group_ppo.core_algos.compute_group_ppo_outputs` returns (and the two that
:func:`~verl_group_ppo.core_algos.compute_group_advantage` returns), its scalars and its ``group/*`` metrics.
Integer and bool tensors are pinned bit for bit (the sha256 of their bytes). Float tensors are pinned by a
fingerprint taken in float64 (the sum, the sum of squares and a position-weighted sum) and float scalars by their
value, compared to :data:`RTOL` of the dtype: the sums a reduction forms depend on the CPU's vector width, so the
last bit of a float32 (and now and then of a float64) result differs from one machine to the next, while any change
to the estimator's results moves a fingerprint far beyond that. A change fails here with the case and the field
named.

Regenerate the pins (after a deliberate change of the estimator's results, never to make a refactor pass)::

    .venv/bin/python tests/test_estimator_pins.py --write-pins   # the pins of the stored batches
    .venv/bin/python tests/test_estimator_pins.py --write        # new demo batches and their pins
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_multiturn_masks import RECORDED, as_batch, load_records

from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import compute_group_advantage, compute_group_ppo_outputs

DATA = Path(__file__).resolve().parent / "data"
DEMO_BATCHES = DATA / "estimator_pin_demo_batches.json"
PINS = DATA / "estimator_pins.json"

DTYPES = {"float32": torch.float32, "float64": torch.float64}

TENSOR_FIELDS = ("advantages", "returns", "group_ids", "endpoint_mask", "critic_mask", "critic_loss_weights")
SCALAR_FIELDS = ("threshold", "boundary_explained_variance", "mean_group_size")

NO_ADAPT = {"adaptive_threshold": False}

#: name -> (verl's algorithm config, the ``threshold`` argument). Together they reach every branch of the
#: estimator: each boundary rule, both ``within_group`` modes, the endpoint policy loss, each ``adv_norm`` (with
#: and without std scaling), per-response lambdas, decoupled and shared lambdas, tau 0, tau inf and a cap of 1.
SETTINGS: dict[str, tuple[dict[str, Any], float | None]] = {
    "defaults": ({}, None),
    "recorded_threshold": ({"gamma": 1.0, "lam": 1.0}, 1.047466637542727),
    "variance_tau_0": ({"group_params": {**NO_ADAPT, "group_variance_threshold": 0.0, "adv_norm": "none"}}, None),
    "variance_one_group_prompt": ({"group_params": {**NO_ADAPT, "group_variance_threshold": float("inf"),
                                                    "group_max_size": 4096, "adv_norm": "prompt"}}, None),
    "variance_prompt_no_std": ({"norm_adv_by_std_in_grpo": False, "group_params": {"adv_norm": "prompt"}}, 0.5),
    "fixed_4_none": ({"group_params": {"boundary_rule": "fixed", "group_max_size": 4, "adv_norm": "none"}}, None),
    "fixed_cap_1": ({"group_params": {"boundary_rule": "fixed", "group_max_size": 1}}, None),
    "low_prob": ({"group_params": {"boundary_rule": "low_prob", "low_prob_threshold": 0.3, "group_max_size": 8}},
                 None),
    "turn_prompt": ({"group_params": {"boundary_rule": "turn", "adv_norm": "prompt"}}, None),
    "per_token": ({"group_params": {"within_group": "per_token"}}, 2.0),
    "per_token_turn_prompt": ({"group_params": {"within_group": "per_token", "boundary_rule": "turn",
                                                "adv_norm": "prompt"}}, None),
    "endpoints": ({"group_params": {"policy_loss_on": "endpoints"}}, None),
    "endpoints_fixed_prompt": ({"group_params": {"policy_loss_on": "endpoints", "boundary_rule": "fixed",
                                                 "group_max_size": 3, "adv_norm": "prompt"}}, None),
    "endpoints_length_adaptive": ({"group_params": {"policy_loss_on": "endpoints", "length_adaptive_alpha": 0.05}},
                                  None),
    "length_adaptive": ({"lam": 0.95, "group_params": {"length_adaptive_alpha": 0.05}}, None),
    "length_adaptive_per_token_low_prob": ({"group_params": {"length_adaptive_alpha": 0.1, "within_group": "per_token",
                                                             "boundary_rule": "low_prob", "low_prob_threshold": 0.3}},
                                           None),
    "decoupled_lambda": ({"gamma": 0.99, "lam": 0.9, "group_params": {"policy_lam": 0.8, "critic_lam": 1.0}}, None),
    "shared_lambda": ({"gamma": 0.99, "lam": 0.95, "group_params": {"policy_lam": None, "critic_lam": None}}, None),
}


# --------------------------------------------------------------------------------------------------------- inputs


def recorded_inputs() -> dict[str, Any]:
    """The recorded multi-turn step as estimator inputs, (B, T) float64, plus seeded old log-probs (B, T)."""
    batch = as_batch(load_records(RECORDED))
    mask = batch["response_mask"]
    generator = torch.Generator().manual_seed(0)
    old_log_probs = torch.rand(mask.shape, generator=generator, dtype=torch.float64).log()
    return {"rewards": batch["token_level_rewards"], "mask": mask, "values": batch["values"],
            "old_log_probs": old_log_probs, "index": batch["uids"]}


def stored_demo_inputs() -> list[dict[str, Any]]:
    """The demo batches stored in :data:`DEMO_BATCHES`, as estimator inputs ((B, T) float64 tensors)."""
    with open(DEMO_BATCHES) as f:
        stored = json.load(f)
    return [{"rewards": torch.tensor(b["rewards"], dtype=torch.float64),
             "mask": torch.tensor(b["mask"], dtype=torch.float64),
             "values": torch.tensor(b["values"], dtype=torch.float64),
             "old_log_probs": torch.tensor(b["old_log_probs"], dtype=torch.float64),
             "index": b["index"]} for b in stored]


def all_inputs() -> dict[str, dict[str, Any]]:
    """Every pinned batch by name."""
    batches = {"multiturn_step2": recorded_inputs()}
    for i, demo in enumerate(stored_demo_inputs()):
        batches[f"demo_{i}"] = demo
    return batches


def make_demo_batches(n_batches: int = 2, seed: int = 0) -> list[dict[str, list]]:
    """Sample ``n_batches`` batches with the demo's RL loop (tiny task, fixed seed; a few seconds on CPU).

    The policy is a short warm start on two-term chains (so that some responses are right); the critic's value
    head is drawn from a seeded normal so that the values differ from token to token. Returns the inputs as
    JSON-ready lists (floats exact).
    """
    from experiments.demo.arms import ARMS
    from experiments.demo.rl import RunConfig, build_learner, collect
    from verl_group_ppo.tasks.tiny.problems import ChainSumTask, split_problems
    from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer
    from verl_group_ppo.tasks.tiny.warmstart import train_warmstart

    torch.set_num_threads(1)
    task = ChainSumTask(min_terms=2, max_terms=2)  # short chains: some rewards after a short warm start
    train, _ = split_problems(task, 400, 16)
    tok = CharTokenizer.train(task.corpus(200) + [task.alphabet])
    cfg = RunConfig(steps=3, prompts_per_step=6, n_samples=4).resolved(task)
    policy, _ = train_warmstart(task, tok, train, "tiny", steps=300, batch_size=16, lr=3e-3, seed=seed,
                                response_len=cfg.response_len, device="cpu")
    init = {"state_dict": {k: v.clone() for k, v in policy.state_dict().items()}, "size": "tiny"}
    learner = build_learner(ARMS["group_ppo"], seed, cfg, tok, init, "cpu")
    with torch.no_grad():
        learner.critic.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    out = []
    for _ in range(n_batches):
        batch = collect(learner, cfg, task, tok, train)
        out.append({"rewards": batch.rewards.tolist(), "mask": batch.mask.int().tolist(),
                    "values": batch.values.tolist(), "old_log_probs": batch.old_log_probs.tolist(),
                    "index": [int(i) for i in batch.index]})
    return out


# ----------------------------------------------------------------------------------------------------------- pins


#: relative tolerance of a float pin by dtype: a few units in the last place of a sum of the batch's size
RTOL = {"torch.float32": 1e-6, "torch.float64": 1e-12}
#: the smallest scale a scalar or metric is compared on: the advantages' mean after normalisation is 0 up to
#: rounding (about 1e-11 in float64), all of it the CPU's summation order, so it is compared on the scale of their
#: standard deviation, 1
METRIC_UNIT = 1.0


def tensor_pin(x: torch.Tensor) -> dict[str, Any]:
    """dtype, shape and either the sha256 of the bytes of ``x`` (integer and bool tensors) or its float64
    fingerprint: ``sum``, ``sumsq``, ``wsum`` (the sum weighted by 1, 2, 3, ... in flat order) and ``sumabs``."""
    x = x.detach().cpu().contiguous()
    pin: dict[str, Any] = {"dtype": str(x.dtype), "shape": list(x.shape)}
    if not x.is_floating_point():
        return {**pin, "sha256": hashlib.sha256(x.numpy().tobytes()).hexdigest()}
    flat = x.double().reshape(-1)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return {**pin, "sum": float(flat.sum()), "sumsq": float((flat * flat).sum()),
            "wsum": float((flat * weights).sum()), "sumabs": float(flat.abs().sum())}


def close(got: float, want: float, rtol: float, scale: float | None = None) -> bool:
    """``got`` equals ``want`` to ``rtol`` times ``scale`` (default: the larger magnitude); NaNs equal NaNs."""
    if got == want or (got != got and want != want):
        return True
    return abs(got - want) <= rtol * (scale if scale is not None else max(abs(got), abs(want)))


def matches(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """A tensor's pin against its stored pin: exact for integer and bool tensors; for floats each fingerprint to
    :data:`RTOL` of its scale (the sum of magnitudes, times the length for the weighted sum)."""
    if got["dtype"] != want["dtype"] or got["shape"] != want["shape"]:
        return False
    if "sha256" in want:
        return got.get("sha256") == want["sha256"]
    rtol, n = RTOL[want["dtype"]], max(1, math.prod(want["shape"]))
    scales = {"sum": want["sumabs"], "sumsq": want["sumsq"], "wsum": want["sumabs"] * n, "sumabs": want["sumabs"]}
    return all(close(got[k], want[k], rtol, scales[k]) for k in scales)


def compute_pins(inputs: dict[str, Any], setting: str, dtype: torch.dtype) -> dict[str, Any]:
    """The pins of one batch under one entry of :data:`SETTINGS` with inputs in ``dtype``."""
    config, threshold = SETTINGS[setting]
    rewards, mask, values, old = (inputs[k].to(dtype) for k in ("rewards", "mask", "values", "old_log_probs"))
    out = compute_group_ppo_outputs(rewards, mask, values=values, settings=read_algorithm_settings(config),
                                    index=inputs["index"], old_log_probs=old, threshold=threshold)
    advantages, returns = compute_group_advantage(rewards, mask, values=values, index=inputs["index"],
                                                  config=config, old_log_probs=old, threshold=threshold)
    tensors = {name: tensor_pin(getattr(out, name)) for name in TENSOR_FIELDS}
    tensors["compute_group_advantage.advantages"] = tensor_pin(advantages)
    tensors["compute_group_advantage.returns"] = tensor_pin(returns)
    return {"tensors": tensors,
            "scalars": {name: float(getattr(out, name)) for name in SCALAR_FIELDS},
            "metrics": {key: float(value) for key, value in sorted(out.metrics.items())}}


def all_pins() -> dict[str, dict[str, Any]]:
    """Every case's pins, keyed ``batch/setting/dtype``."""
    return {case_name(batch, setting, dtype): compute_pins(inputs, setting, DTYPES[dtype])
            for batch, inputs in all_inputs().items() for setting in SETTINGS for dtype in DTYPES}


def case_name(batch: str, setting: str, dtype: str) -> str:
    return f"{batch}/{setting}/{dtype}"


def load_pins() -> dict[str, dict[str, Any]]:
    with open(PINS) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def inputs() -> dict[str, dict[str, Any]]:
    return all_inputs()


def test_the_pins_cover_every_batch_setting_and_dtype(inputs):
    expected = {case_name(b, s, d) for b in inputs for s in SETTINGS for d in DTYPES}
    assert set(load_pins()) == expected


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_outputs_are_bit_identical_to_the_pins(inputs, setting):
    pins = load_pins()
    for batch, batch_inputs in inputs.items():
        for dtype in DTYPES:
            case = case_name(batch, setting, dtype)
            got, want = compute_pins(batch_inputs, setting, DTYPES[dtype]), pins[case]
            for name, pin in want["tensors"].items():
                assert matches(got["tensors"][name], pin), f"{case}: tensor {name} {got['tensors'][name]}, pinned {pin}"
            for group in ("scalars", "metrics"):
                assert set(got[group]) == set(want[group]), f"{case}: the {group} keys differ from the pins"
                for key, value in want[group].items():
                    assert close(got[group][key], value, RTOL[str(DTYPES[dtype])], max(abs(value), METRIC_UNIT)), \
                        f"{case}: {group} {key} = {got[group][key]}, pinned {value}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_float_pin_takes_last_bit_noise_and_refuses_a_real_change(inputs, dtype):
    out = compute_group_ppo_outputs(*(inputs["demo_0"][k].to(DTYPES[dtype]) for k in ("rewards", "mask")),
                                    values=inputs["demo_0"]["values"].to(DTYPES[dtype]),
                                    settings=read_algorithm_settings({}), index=inputs["demo_0"]["index"])
    x, want = out.advantages, tensor_pin(out.advantages)
    assert matches(tensor_pin(torch.nextafter(x, torch.full_like(x, float("inf")))), want)  # every element 1 ulp
    changed = x.clone()
    changed.view(-1)[int(torch.argmax(x.abs()))] *= 1.001  # one element of the batch moved by 0.1%
    assert not matches(tensor_pin(changed), want)
    assert not matches(tensor_pin(x.flip(0)), want)  # the same values at other places
    assert not matches(tensor_pin(out.group_ids + 1), tensor_pin(out.group_ids))


def test_the_settings_reach_the_branches_they_name(inputs):
    """The pinned cases exercise what they claim: holes in the recorded step, rewards in every batch, cuts under
    low_prob with groups longer than a token, and a prompt id shared by several responses in every batch."""
    recorded = inputs["multiturn_step2"]["mask"]
    assert bool(((recorded[:, 1:] == 1) & (recorded[:, :-1] == 0) & (recorded.cumsum(1)[:, :-1] > 0)).any())
    for batch, batch_inputs in inputs.items():
        assert len(set(batch_inputs["index"])) < len(batch_inputs["index"]), batch
        assert bool((batch_inputs["rewards"] != 0).any()), batch
        pins = compute_pins(batch_inputs, "low_prob", torch.float64)
        assert 1.0 < pins["metrics"]["group/mean_group_size"] < 8.0, batch


def main(argv: list[str]) -> int:
    """``--write``: sample the demo batches and write them and the pins of the current estimator;
    ``--write-pins``: the pins of the stored batches only."""
    if argv not in (["--write"], ["--write-pins"]):
        print(__doc__)
        return 2
    if argv == ["--write"]:
        DEMO_BATCHES.write_text(json.dumps(make_demo_batches()) + "\n")
    PINS.write_text(json.dumps(all_pins(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DEMO_BATCHES.name} and {PINS.name}" if argv == ["--write"] else f"wrote {PINS.name}")
    return 0


if __name__ == "__main__":  # run as a script, Python puts this folder on sys.path
    sys.exit(main(sys.argv[1:]))
