"""Value sources through the GROUP-PPO trainer's advantage step, on a real TransferQueue: ``prefix_tree`` and ``mc``
give the estimator the values of the loop references, no critic field is read or written, ``mc`` hands the estimator
the groups its continuations were sampled from, and samples them in one batch through the rollout client (a
stand-in here) and scores them with the run's function (:mod:`verl_group_ppo.values.mc_rollout`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import verl_group_ppo_testutils_integration as U
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import compute_group_ppo_outputs, find_group_endpoints, group_start_mask
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY
from verl_group_ppo.values import Prefix, mc_rollout
from verl_group_ppo.values.mc import boundary_prefixes
from verl_group_ppo_testutils_reference import loop_mc_boundary_values, loop_prefix_tree_values
from verl_group_ppo_testutils_values import handed_endpoints  # noqa: F401 - a fixture

N = ["actor_rollout_ref.rollout.n=4"]  # the batches hold 4 replies per prompt
PREFIX_TREE = ["++algorithm.group_params.value_source=prefix_tree", *N]
MC = ["++algorithm.group_params.value_source=mc", "++algorithm.group_params.group_max_size=3",
      "++algorithm.group_params.mc_samples=3", "actor_rollout_ref.rollout.response_length=16", *N]


def shared_prefix_samples(seed: int = 0) -> list[dict]:
    """3 prompts x 4 replies over a 3-token vocabulary (so prefixes are shared), lengths differ, one reply with a
    hole, the prompts' replies interleaved in the batch (as after verl's batch balancing)."""
    samples = U.make_samples(n_prompts=3, n_per_prompt=4, max_response=8, seed=seed, with_padding_row=False)
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        s["responses"] = torch.randint(1, 4, s["responses"].shape, generator=g)
        s["data_source"] = "toy"
        s["reward_model"] = {"ground_truth": "1"}
        s["extra_info"] = {"row": 1}
    order = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    return [samples[i] for i in order]


def uids_of(meta) -> list[str]:
    return [key.split("_")[0] for key in meta.keys]


def estimator_outputs(trainer, meta, values):
    stored = U.get_padded(meta, ["response_mask", "rm_scores", "old_log_probs"])
    return compute_group_ppo_outputs(stored["rm_scores"], stored["response_mask"], values=values,
                                     index=np.array(uids_of(meta), dtype=object),
                                     settings=read_algorithm_settings(trainer.config.algorithm),
                                     old_log_probs=stored["old_log_probs"], threshold=1.0)


def test_prefix_tree_values_reach_the_estimator_and_no_critic_field_is_stored(ray_tq, handed_endpoints):
    trainer = U.make_trainer(PREFIX_TREE)
    assert not trainer.use_critic
    samples = shared_prefix_samples()
    meta = U.put_samples(samples)
    metrics: dict = {}
    out = trainer._compute_advantage(meta, metrics)
    assert CRITIC_WEIGHTS_KEY not in out.fields

    # the loop reference over the whole batch: a prompt's replies are grouped by uid wherever they sit
    ids = [s["responses"].tolist() for s in samples]
    width = max(len(r) for r in ids)
    padded = [r + [0] * (width - len(r)) for r in ids]
    exists = [[1] * len(r) + [0] * (width - len(r)) for r in ids]
    scores = [float(s["rm_scores"].sum()) for s in samples]
    want = torch.tensor(loop_prefix_tree_values(padded, exists, scores, uids_of(meta)))
    assert any(len(set(tuple(r[:2]) for r, u in zip(ids, uids_of(meta)) if u == uid)) < 4
               for uid in set(uids_of(meta))), "the batch should share prefixes"

    stored = U.get_padded(out, ["advantages", "returns"])
    expected = estimator_outputs(trainer, out, want.float())
    assert torch.equal(stored["advantages"], expected.advantages)
    assert torch.equal(stored["returns"], expected.returns)
    assert {k: metrics[k] for k in expected.metrics} == expected.metrics
    assert "group/mc_responses" not in metrics
    assert handed_endpoints == [None]  # the estimator finds the groups


def test_tree_nodes_reach_the_estimator_under_parent_normalisation(ray_tq, handed_endpoints):
    """boundary_rule tree + adv_norm parent: the trainer hands the estimator the branch endpoints and the tree's
    nodes, both found from the stored tokens, and stores what the estimator gives for them."""
    from verl_group_ppo.values.prefix_tree import branch_endpoints, parent_nodes

    trainer = U.make_trainer([*PREFIX_TREE, "++algorithm.group_params.boundary_rule=tree",
                              "++algorithm.group_params.adv_norm=parent",
                              "actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn"])
    samples = shared_prefix_samples(seed=1)  # independent replies over 3 tokens: they share prefixes as a tree does
    for sample in samples:
        sample["response_mask"] = torch.ones_like(sample["response_mask"])  # single-turn: no holes
        sample["extra_fields"] = {"tree_parent": -1, "tree_branch_position": 0, "tree_level": 0,
                                  "tree_generated_tokens": len(sample["responses"]), "tree_generate_s": 0.1}
    meta = U.put_samples(samples)
    out = trainer._compute_advantage(meta, {})
    stored = U.get_padded(out, ["responses", "response_mask", "rm_scores", "advantages"])
    uids = uids_of(out)
    exists = stored["response_mask"]  # no holes: a reply's positions are its trained ones
    ends = branch_endpoints(stored["responses"], exists, stored["response_mask"], uids)
    assert handed_endpoints and torch.equal(handed_endpoints[0], ends)
    nodes = parent_nodes(stored["responses"], exists, uids)
    scores = stored["rm_scores"].sum(dim=1)
    values = torch.tensor(loop_prefix_tree_values(stored["responses"].tolist(), exists.tolist(), scores.tolist(), uids))
    want = compute_group_ppo_outputs(stored["rm_scores"], stored["response_mask"], values=values.float(),
                                     index=np.array(uids, dtype=object),
                                     settings=read_algorithm_settings(trainer.config.algorithm), endpoints=ends,
                                     parent_nodes=nodes, threshold=1.0)
    assert torch.allclose(stored["advantages"], want.advantages, atol=1e-6)
    plain = compute_group_ppo_outputs(stored["rm_scores"], stored["response_mask"], values=values.float(),
                                      index=np.array(uids, dtype=object), endpoints=ends, threshold=1.0,
                                      settings=read_algorithm_settings({"group_params": {
                                          "value_source": "prefix_tree", "boundary_rule": "tree"}}))
    assert not torch.allclose(want.advantages, plain.advantages)  # parent is not the batch whitening


class FakeClient:
    """verl's ``LLMServerClient.generate`` stand-in: each request answers ``[7] * (1 + len(prompt) % 3)``, capped at
    the request's ``max_tokens``; records the requests and how many were in flight together."""

    def __init__(self):
        self.requests, self.in_flight, self.most_in_flight = [], 0, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.requests.append((list(prompt_ids), dict(sampling_params)))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        return SimpleNamespace(token_ids=[7] * min(1 + len(prompt_ids) % 3, sampling_params["max_tokens"]),
                               stop_reason="completed")


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens
        return " ".join(str(i) for i in ids)


def deterministic_score(data_source, solution_str, ground_truth, extra_info):
    """1 when the reply's first token is 1, whatever follows: the value of every prefix is exactly known."""
    assert (data_source, ground_truth, extra_info) == ("toy", "1", {"row": 1})
    return {"score": float(solution_str.split()[0] == "1"), "acc": 0.0}


def mc_trainer(monkeypatch, score_fn=deterministic_score):
    """The mc trainer with stand-ins for verl's rollout client, replicas and tokenizer, and ``score_fn`` as the run's
    reward function."""
    monkeypatch.setattr(mc_rollout, "reward_function", lambda config: score_fn)
    trainer = U.make_trainer(MC)
    client, calls = FakeClient(), []
    trainer.get_llm_client = lambda: client
    trainer.checkpoint_manager = SimpleNamespace(update_weights=lambda step: calls.append(("update_weights", step)),
                                                 sleep_replicas=lambda: calls.append(("sleep",)))
    trainer.tokenizer = FakeTokenizer()
    trainer.timing_raw = {}
    trainer.global_steps = 3
    return trainer, client, calls


def test_mc_samples_k_continuations_per_boundary_in_one_batch_and_gives_the_exact_value(ray_tq, monkeypatch,
                                                                                      handed_endpoints):
    trainer, client, calls = mc_trainer(monkeypatch)
    assert not trainer.use_critic
    samples = shared_prefix_samples(seed=1)
    meta = U.put_samples(samples)
    metrics: dict = {}
    out = trainer._compute_advantage(meta, metrics)
    assert CRITIC_WEIGHTS_KEY not in out.fields
    assert calls == [("update_weights", 3), ("sleep",)]  # woken with the batch's weights, asleep again after

    stored = U.get_padded(out, ["response_mask", "responses", "rm_scores"])
    starts = group_start_mask(find_group_endpoints(torch.zeros_like(stored["rm_scores"]), stored["response_mask"],
                                                   boundary_rule="fixed", group_max_size=3), stored["response_mask"])
    assert len(handed_endpoints) == 1 and torch.equal(handed_endpoints[0], find_group_endpoints(
        torch.zeros_like(stored["rm_scores"]), stored["response_mask"], boundary_rule="fixed", group_max_size=3))
    later = starts.clone()
    later[:, 0] = False
    n_starts = int(later.sum())
    assert n_starts > len(samples)
    assert metrics["group/mc_responses"] == 3 * n_starts == len(client.requests)
    assert client.most_in_flight == len(client.requests)  # every request in flight at once: one batch
    assert metrics["group/mc_tokens"] == sum(1 + len(p) % 3 if 1 + len(p) % 3 <= sp["max_tokens"] else sp["max_tokens"]
                                             for p, sp in client.requests)
    assert {"group_mc", "group_mc_generate", "group_mc_score"} <= set(trainer.timing_raw)

    # each request is the prompt plus the reply up to its boundary, with the reply's remaining budget
    rows = later.nonzero().tolist()
    for i, (row, start) in enumerate(rows):
        for j in range(3):
            prompt_ids, params = client.requests[3 * i + j]
            assert prompt_ids == samples[row]["prompts"].tolist() + samples[row]["responses"][:start].tolist()
            assert params["max_tokens"] == 16 - start and params["temperature"] == 1.0

    # the deterministic reward: the value at every start after position 0 is exactly the reply's own first-token
    # score, and at position 0 the prompt's mean reward
    first_is_one = [float(s["responses"][0] == 1) for s in samples]
    continuation_scores = [[first_is_one[row]] * 3 for row, _ in rows]
    scores = [float(s["rm_scores"].sum()) for s in samples]
    want = torch.tensor(loop_mc_boundary_values(starts.tolist(), continuation_scores, scores, uids_of(meta)))
    expected = estimator_outputs(trainer, out, want.float())
    assert torch.equal(U.get_padded(out, ["advantages"])["advantages"], expected.advantages)


def recording_score(seen: list):
    """A reward function that scores 0.5 and keeps what it was called with."""

    def score(data_source, solution_str, ground_truth, extra_info):
        seen.append({"solution_str": solution_str, "extra_info": extra_info})
        return 0.5

    return score


def test_mc_scores_through_the_runs_reward_function_as_verls_reward_loop_decodes(ray_tq, monkeypatch,
                                                                               handed_endpoints):
    calls = []
    trainer, client, _ = mc_trainer(monkeypatch, recording_score(calls))
    samples = shared_prefix_samples(seed=2)
    trainer._compute_advantage(U.put_samples(samples), {})
    # the scored text is the reply's prefix followed by the continuation, without the prompt
    prompt_len = {tuple(s["prompts"].tolist()): len(s["prompts"]) for s in samples}
    decoded = []
    for prompt_ids, _ in client.requests:
        n = next(n for p, n in prompt_len.items() if tuple(prompt_ids[:n]) == p)
        tokens = [7] * min(1 + len(prompt_ids) % 3, 16 - (len(prompt_ids) - n))
        decoded.append(" ".join(str(t) for t in prompt_ids[n:] + tokens))
    assert [c["solution_str"] for c in calls] == decoded


def test_boundary_prefixes_leave_position_zero_to_the_prompt_mean_and_requests_keep_the_replys_budget():
    starts = torch.tensor([[True, False, True, True], [True, True, False, False]])
    responses = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    prefixes = boundary_prefixes([[1], [2, 3]], responses, starts, ["r0", "r1"])
    assert [(p.row, p.prompt_ids, p.reply_ids, p.reward_input) for p in prefixes] == [
        (0, [1], [5, 6], "r0"), (0, [1], [5, 6, 7], "r0"), (1, [2, 3], [9], "r1")]
    requests = mc_rollout.continuation_requests(prefixes, response_length=4)
    assert [(r.prompt_ids, r.max_tokens) for r in requests] == [([1, 5, 6], 2), ([1, 5, 6, 7], 1), ([2, 3, 9], 3)]
    assert mc_rollout.continuation_requests(prefixes[1:2], response_length=2)[0].max_tokens == 1  # at least one


def test_rollout_sampling_params_follow_the_rollouts():
    config = U.compose_config(["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.9",
                               "actor_rollout_ref.rollout.top_k=5"])
    assert mc_rollout.rollout_sampling_params(config) == {"temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                                         "repetition_penalty": 1.0, "logprobs": False}


def test_an_aborted_continuation_is_an_error():
    class Aborting:
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            return SimpleNamespace(token_ids=[], stop_reason="aborted")

    request = mc_rollout.Request(prompt_ids=[1, 2], max_tokens=3)
    with pytest.raises(RuntimeError, match="aborted"):
        asyncio.run(mc_rollout.sample_continuations(Aborting(), [request], 2, {}))


def test_the_rollout_sampler_wakes_samples_sleeps_and_scores_in_that_order():
    events = []

    class Client:
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            events.append("generate")
            return SimpleNamespace(token_ids=[prompt_ids[-1]] * 2, stop_reason="completed")

    def score(data_source, solution_str, ground_truth, extra_info):
        events.append("score")
        return float(solution_str == "5 6 6 6") + 10 * float(extra_info["row"])

    config = U.compose_config(["actor_rollout_ref.rollout.response_length=8"])
    sampler = mc_rollout.RolloutSampler(config=config, tokenizer=FakeTokenizer(), client=Client,
                                        wake=lambda: events.append("wake"), sleep=lambda: events.append("sleep"),
                                        score_fn=score)
    info = mc_rollout.row_info(["toy"], [{"ground_truth": "1"}], [{"row": 1}])[0]
    out = sampler([Prefix(row=0, prompt_ids=[1], reply_ids=[5, 6], reward_input=info),
                   Prefix(row=0, prompt_ids=[1], reply_ids=[5], reward_input=info)], k=2)
    assert events == ["wake"] + ["generate"] * 4 + ["sleep"] + ["score"] * 4
    assert out.scores.tolist() == [[11.0, 11.0], [10.0, 10.0]] and out.tokens == 8


def test_mc_without_an_extra_info_column_hands_the_reward_an_empty_one(ray_tq, monkeypatch, handed_endpoints):
    calls = []
    trainer, client, _ = mc_trainer(monkeypatch, recording_score(calls))
    samples = shared_prefix_samples(seed=3)
    for s in samples:
        del s["extra_info"]
    trainer._compute_advantage(U.put_samples(samples), {})
    assert calls and all(c["extra_info"] == {} for c in calls)
