"""The ``hf`` rollout (``verl_group_ppo.rollout``): its registration with verl on any platform, batched sampling
(left padding, log-probs, EOS and budget per request, the device), the server's batching, abort and resume and
exact weight loads, the adapter's weight sync through Ray, and the replay buffer's short poll. Models are tiny
random Qwen2s built here (no downloads)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest
import torch
import verl_group_ppo_testutils_cpu as cpu_utils
from omegaconf import OmegaConf

import verl_group_ppo.rollout as hf_rollout
import verl_group_ppo.rollout.replica as replica_module
import verl_group_ppo.rollout.server as server_module
from verl_group_ppo.rollout import generation, sampler
from verl_group_ppo.rollout.adapter import HFRolloutAdapter
from verl_group_ppo.rollout.generation import SamplingRequest, generate_batch
from verl_group_ppo.rollout.model import server_device, visible_device_count
from verl_group_ppo.rollout.prefix_cache import PrefixCache
from verl_group_ppo.rollout.replica import HFRolloutReplica
from verl_group_ppo.rollout.requests import resolve_max_tokens, to_sampling_request
from verl_group_ppo.rollout.server import HFRolloutServer, server_actor_name

# ==================================================================================================
# registration: by name, on any platform


def test_plugin_registers_the_hf_rollout_by_name_on_any_platform(monkeypatch):
    """The plugin's installs (run when verl imports each registry module) register ``hf`` whatever
    VERL_PLATFORM says; verl's own lookups then find the adapter and the replica."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout import replica as rollout_replica

    from verl_group_ppo.integration import entry_point

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(rollout_base, "_ROLLOUT_REGISTRY", {})
    monkeypatch.setattr(rollout_replica.RolloutReplicaRegistry, "_registry", {})
    entry_point.install_hf_adapter(rollout_base)
    entry_point.install_hf_replica(rollout_replica)
    assert rollout_base._ROLLOUT_REGISTRY == {("hf", "async"): hf_rollout.ADAPTER_PATH}
    assert rollout_base.get_rollout_class("hf") is HFRolloutAdapter
    assert rollout_replica.get_rollout_replica_class("hf") is HFRolloutReplica


# ==================================================================================================
# batched generation


def _requests(lengths, max_tokens=8, temperature=0.0, **kwargs):
    prompts = [[(7 * i + 3 * j) % (cpu_utils.VOCAB - 2) + 2 for j in range(n)] for i, n in enumerate(lengths)]
    return [SamplingRequest(tuple(p), max_tokens=max_tokens, temperature=temperature, **kwargs) for p in prompts]


def test_left_pad_and_positions():
    ids, mask = generation.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert generation.position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_top_k_top_p_filter():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    kept = generation.filter_top_k_top_p(logits, torch.tensor([1, -1, -1]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False], [True] * 4, [True, False, False, False]]


def test_batched_greedy_equals_each_request_alone_and_hf_generate():
    """Left padding changes nothing: each row of a mixed-length batch matches its own unpadded run."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([3, 9, 5, 12])
    batched = generate_batch(model, requests, eos_token_ids=[], pad_token_id=cpu_utils.PAD_ID)
    for request, completion in zip(requests, batched):
        alone = generate_batch(model, [request], eos_token_ids=[], pad_token_id=cpu_utils.PAD_ID)[0]
        assert completion.token_ids == alone.token_ids
        assert completion.log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    reference = model.generate(torch.tensor([requests[1].prompt_ids]), do_sample=False, max_new_tokens=8,
                               min_new_tokens=8, pad_token_id=cpu_utils.PAD_ID)
    assert batched[1].token_ids == reference[0, len(requests[1].prompt_ids):].tolist()


def test_sampled_log_probs_are_those_of_the_sampling_distribution():
    """Log-probs of sampled tokens (temperature 0.7) equal a teacher-forced recomputation of
    log_softmax(logits / 0.7) at each response position."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([4, 7], max_tokens=6, temperature=0.7)
    completions = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator().manual_seed(3))
    for request, completion in zip(requests, completions):
        sequence = torch.tensor([list(request.prompt_ids) + completion.token_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(request.prompt_ids) - 1:-1] / 0.7
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert completion.log_probs == pytest.approx(expected.tolist(), abs=1e-4)


def test_each_request_stops_at_its_own_eos_and_budget():
    model = cpu_utils.tiny_qwen2()
    requests = _requests([3, 9, 5], max_tokens=10)
    free = generate_batch(model, requests, [], cpu_utils.PAD_ID)
    eos = free[0].token_ids[2]
    stopped = generate_batch(model, requests, [eos], cpu_utils.PAD_ID)
    for before, after in zip(free, stopped):
        expected = before.token_ids[:before.token_ids.index(eos) + 1] if eos in before.token_ids else before.token_ids
        assert after.token_ids == expected and after.stopped_at_eos == (eos in before.token_ids)
    assert len(stopped[0].token_ids) <= 3 and stopped[0].stopped_at_eos
    short = generate_batch(model, [requests[0], _requests([4], max_tokens=2)[0]], [], cpu_utils.PAD_ID)
    assert [len(c.token_ids) for c in short] == [10, 2]


def test_rows_that_join_a_running_batch_decode_as_they_would_alone():
    """Continuous batching: rows join between steps (prefilled, their cache left-padded into the running one)
    and leave when they stop; every row's greedy reply and log-probs equal its own unbatched run, and the cache
    columns only departed rows attended to are dropped."""
    model = cpu_utils.tiny_qwen2()
    long_prompt, short, medium, late = _requests([14, 3, 5, 4], max_tokens=8)
    long_prompt, short = dataclasses.replace(long_prompt, max_tokens=3), dataclasses.replace(short, max_tokens=2)
    running = generation.RunningBatch(model, [], cpu_utils.PAD_ID)
    running.admit([("long", long_prompt), ("short", short)])
    done = dict(running.step())
    running.admit([("medium", medium)])
    assert len(running) == 3 and running._mask.shape[1] == 15, "joined rows are left-padded to the batch's width"
    for _ in range(2):
        done.update(running.step())
    assert set(done) == {"long", "short"} and len(running) == 1
    assert running._mask.shape[1] == 5 + 2, "the columns of the departed rows' prompts are dropped"
    running.admit([("late", late)])
    while len(running):
        done.update(running.step())
    for key, request in {"long": long_prompt, "short": short, "medium": medium, "late": late}.items():
        alone = generate_batch(model, [request], [], cpu_utils.PAD_ID)[0]
        assert done[key].token_ids == alone.token_ids and len(alone.token_ids) == request.max_tokens, key
        assert done[key].log_probs == pytest.approx(alone.log_probs, abs=1e-5), key
    assert running.step() == [] and running.accepts_joins()


# ----------------------------------------------------------------------------------------------------
# the device: every tensor and the seeded generator on the trainer's device, CPU results unchanged


def test_generation_on_an_explicit_device_equals_the_models_device():
    """Seeded sampling with ``device="cpu"`` given gives exactly the tokens and log-probs of the default."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([4, 7, 2], max_tokens=6, temperature=0.9, top_k=20, top_p=0.9)
    default = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator().manual_seed(5))
    explicit = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator(device="cpu").manual_seed(5),
                              device="cpu")
    assert explicit == default


def test_generation_refuses_a_device_the_model_is_not_on():
    model = cpu_utils.tiny_qwen2()
    with pytest.raises(ValueError, match=r"device='meta' but the model's parameters are on cpu"):
        generate_batch(model, _requests([3]), [], cpu_utils.PAD_ID, device="meta")


def test_sampler_refuses_a_generator_of_another_device():
    """``torch.multinomial`` takes only a generator of the tensors' device; the sampler says which one to make
    (a CPU generator with CUDA logits, and a CUDA generator with CPU logits, the CUDA one faked here)."""
    logits = torch.zeros(2, 5)
    settings = (torch.ones(2), torch.full((2,), -1), torch.ones(2))
    cuda_generator = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"torch.Generator\(device='cpu'\)"):
        generation.sample_tokens(logits, *settings, generator=cuda_generator)
    with pytest.raises(ValueError, match=r"torch.Generator\(device='cuda'\)"):
        generation.check_generator_device(torch.Generator(), "cuda:0")
    generation.check_generator_device(torch.Generator(), "cpu")
    generation.check_generator_device(None, "cuda")


def test_server_device_follows_the_trainers_device_kind():
    assert server_device("cpu", replica_rank=3, device_count=0) == torch.device("cpu")
    assert server_device("cuda", replica_rank=3, device_count=2) == torch.device("cuda", 1)
    assert server_device("cuda", replica_rank=0, device_count=8) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        server_device("cuda", replica_rank=0, device_count=0)
    assert visible_device_count("cpu") == 0
    assert visible_device_count("cuda") == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_server_puts_model_and_generator_on_its_device(monkeypatch):
    """The server generates on the device kind it is given; on CPU its seeded generator samples exactly what a
    default ``torch.Generator`` with the same seed samples; asking for CUDA where none is visible fails at once."""
    model = cpu_utils.tiny_qwen2()
    server = HFRolloutServer(OmegaConf.create({"prompt_length": 32, "response_length": 6, "seed": 4}),
                                     None, replica_rank=1, model=model, device_type="cpu")
    assert server.device == torch.device("cpu") and server.generator.device == torch.device("cpu")
    requests = _requests([3, 6], max_tokens=6, temperature=1.0)  # the config's response_length
    expected = generate_batch(model, requests, server.eos_token_ids, server.pad_token_id,
                              torch.Generator().manual_seed(5))
    seen = []

    class _Recorded(generation.RunningBatch):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["device"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(server_module, "RunningBatch", _Recorded)
    outputs = asyncio.run(_send(server, requests, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}))
    assert [(o.token_ids, o.log_probs) for o in outputs] == [(c.token_ids, c.log_probs) for c in expected]
    assert seen == [torch.device("cpu")], "the server must hand its device to the generation"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees no cuda device"):
            HFRolloutServer(OmegaConf.create({}), None, model=model, device_type="cuda")


def test_replica_launches_its_server_on_the_trainers_device_kind(monkeypatch):
    """``launch_servers`` hands the server verl's device name of the launching process."""
    launched = {}

    class _Remote:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **options):
            return self

        def remote(self, **kwargs):
            launched.update(kwargs)
            return SimpleNamespace(stats=SimpleNamespace(remote=lambda: asyncio.sleep(0)))

    monkeypatch.setattr(replica_module.ray, "remote", _Remote)
    monkeypatch.setattr(replica_module, "trainer_device_type", lambda: "cuda")
    monkeypatch.setattr(HFRolloutReplica, "max_concurrency", 8)
    replica = HFRolloutReplica.__new__(HFRolloutReplica)
    replica.replica_rank, replica.name_suffix = 0, ""
    replica.config, replica.model_config = OmegaConf.create({}), None
    asyncio.run(replica.launch_servers())
    assert launched["device_type"] == "cuda" and launched["replica_rank"] == 0


def test_resolve_max_tokens_follows_verls_vllm_server():
    assert resolve_max_tokens({}, prompt_len=40, prompt_length=64, response_length=32, max_model_len=None) == 32
    assert resolve_max_tokens({}, prompt_len=80, prompt_length=64, response_length=32, max_model_len=None) == 16
    assert resolve_max_tokens({"max_tokens": 5}, 10, 64, 32, None) == 5
    assert resolve_max_tokens({"max_new_tokens": 50}, 10, 64, 32, max_model_len=20) == 10
    with pytest.raises(ValueError, match="no room"):
        resolve_max_tokens({}, 96, 64, 32, None)


def test_sampling_params_the_rollout_cannot_apply_are_refused_or_reported(caplog):
    config = OmegaConf.create({"prompt_length": 32, "response_length": 6})
    with pytest.raises(NotImplementedError, match="repetition_penalty=1.2"):
        to_sampling_request([5, 6], {"repetition_penalty": 1.2}, config)
    with caplog.at_level(logging.WARNING, logger="verl_group_ppo.rollout"):
        request = to_sampling_request([5, 6], {"temperature": 0.5, "repetition_penalty": 1.0,
                                                       "presence_penalty_test_key": 0.3}, config)
    assert request.temperature == 0.5 and request.max_tokens == 6
    assert any("presence_penalty_test_key" in record.getMessage() for record in caplog.records)


async def _send(server, requests, params):
    """Send ``requests`` to ``server`` concurrently with ``params`` (a dict, or a function of the request's
    position); their ``TokenOutput``s in order."""
    return await asyncio.gather(*[
        server.generate(str(i), list(r.prompt_ids), params(i) if callable(params) else dict(params))
        for i, r in enumerate(requests)])


def _server(model, **config):
    settings = {"prompt_length": 32, "response_length": 6, "seed": 0, "max_num_seqs": 64, **config}
    return HFRolloutServer(OmegaConf.create(settings), None, model=model)


def test_server_batches_concurrent_requests_into_one_generate():
    model = cpu_utils.tiny_qwen2()
    server = _server(model)
    requests = _requests([3, 9, 5, 12, 4, 6], max_tokens=6)

    outputs = asyncio.run(_send(server, requests, lambda i: {"temperature": 0, "top_p": 1.0, "top_k": -1,
                                                              "logprobs": i % 2 == 0}))
    assert server.batch_sizes == [6], "six concurrent requests must be generated as one batch"
    alone = generate_batch(model, requests, [cpu_utils.EOS_ID], cpu_utils.PAD_ID)
    for i, (out, expected) in enumerate(zip(outputs, alone)):
        assert out.token_ids == expected.token_ids
        assert (out.log_probs is None) == (i % 2 == 1)
        assert out.stop_reason == "completed" and out.extra_fields == {"global_steps": None}


class _WrappedModel(torch.nn.Module):
    """A causal LM around ``model`` that counts its forward passes (``calls``) and records the (rows, positions) of
    each pass's input (``shapes``); subclasses act in :meth:`before` at a chosen pass."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls, self.shapes = model, 0, []
        self.generation_config, self.config = model.generation_config, model.config

    def before(self) -> None:
        """Called at the start of each forward pass, after ``calls`` counts it."""

    def forward(self, **kwargs):
        self.calls += 1
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        self.before()
        return self.model(**kwargs)


class _GatedModel(_WrappedModel):
    """A causal LM whose ``pause_at``-th forward pass (1 = the prompt's) signals ``reached`` and then waits for
    ``release``: the test decides what happens while a batch is running, at a known decoding step."""

    def __init__(self, model, pause_at: int):
        super().__init__(model)
        self.pause_at = pause_at
        self.reached, self.release = threading.Event(), threading.Event()

    def before(self) -> None:
        if self.calls == self.pause_at:
            self.reached.set()
            if not self.release.wait(timeout=120):
                raise TimeoutError("the test never released the paused forward pass")


def _late_request(model):
    """Two greedy requests decode (8 tokens each, EOS ignored); a third arrives while the batch runs its third
    forward pass. Returns (the three replies in order, the server, the (rows, positions) of every forward pass)."""
    gated = _GatedModel(model, pause_at=3)
    server = _server(gated, response_length=8, ignore_eos=True)
    requests = _requests([3, 6, 4], max_tokens=8)
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def scenario():
        first = [asyncio.create_task(server.generate(str(i), list(r.prompt_ids), greedy))
                 for i, r in enumerate(requests[:2])]
        assert await asyncio.to_thread(gated.reached.wait, 120), "the batch never reached its third forward pass"
        late = asyncio.create_task(server.generate("late", list(requests[2].prompt_ids), greedy))
        await asyncio.sleep(0)
        gated.release.set()
        return await asyncio.gather(*first, late)

    return asyncio.run(scenario()), server, gated.shapes


def test_a_request_that_arrives_mid_batch_joins_it_before_its_next_step():
    """A request sent while a batch decodes is prefilled alone and then decoded in the same forward passes as the
    running rows (3 rows a step), not after them; every reply equals the request's unbatched run."""
    model = cpu_utils.tiny_qwen2()
    outputs, server, shapes = _late_request(model)
    assert server.batch_sizes == [2, 1], "the first two requests' prefill, then the late one's"
    assert shapes[3] == (1, 4), "the late request is prefilled right after the step it arrived in"
    assert (3, 1) in shapes, "the late request must decode in the running batch's steps"
    # 2 prefills, the 7 decoding steps of the first rows (the late row in the last 6) and the late row's last 2:
    # 11 forward passes, where decoding it after the batch would take 16
    assert len(shapes) == 11
    for out, request in zip(outputs, _requests([3, 6, 4], max_tokens=8)):
        alone = generate_batch(model, [request], [], cpu_utils.PAD_ID)[0]
        assert out.token_ids == alone.token_ids and out.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_a_cache_that_cannot_merge_makes_late_requests_wait_for_the_batch(monkeypatch):
    """Where the model's cache is not the plain dynamic one, a request that arrives mid-batch is decoded after the
    batch (16 forward passes, not 11), and a direct ``admit`` into a running batch is refused."""
    monkeypatch.setattr(generation, "_mergeable", lambda cache: False)
    model = cpu_utils.tiny_qwen2()
    outputs, server, shapes = _late_request(model)
    assert server.batch_sizes == [2, 1] and len(shapes) == 16 and (3, 1) not in shapes
    assert [len(o.token_ids) for o in outputs] == [8, 8, 8]
    requests = _requests([3, 6], max_tokens=8)
    running = generation.RunningBatch(model, [], cpu_utils.PAD_ID)
    running.admit([(0, requests[0])])
    with pytest.raises(RuntimeError, match="cannot take rows while others decode"):
        running.admit([(1, requests[1])])


class _FailingModel(_WrappedModel):
    """A causal LM whose ``fail_at``-th forward pass raises."""

    def __init__(self, model, fail_at: int):
        super().__init__(model)
        self.fail_at = fail_at

    def before(self) -> None:
        if self.calls == self.fail_at:
            raise RuntimeError("forward pass failed on purpose")


def test_a_failed_batch_answers_every_caller_with_the_error_and_the_server_goes_on():
    server = _server(_FailingModel(cpu_utils.tiny_qwen2(), fail_at=2), response_length=4, ignore_eos=True)
    requests = _requests([3, 6], max_tokens=4)
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1}

    async def scenario():
        failed = await asyncio.gather(*[server.generate(str(i), list(r.prompt_ids), greedy)
                                        for i, r in enumerate(requests)], return_exceptions=True)
        return failed, await server.generate("after", list(requests[0].prompt_ids), greedy)

    failed, after = asyncio.run(scenario())
    assert all(isinstance(e, RuntimeError) and "on purpose" in str(e) for e in failed)
    assert after.stop_reason == "completed" and len(after.token_ids) == 4


def test_abort_stops_running_answers_waiting_and_holds_new_until_resume():
    """verl's partial rollout: abort -> running rows return their tokens so far and waiting requests return
    empty, both ``aborted``; a request sent while paused waits for resume_generation.

    The batch pauses inside its third forward pass (the prompt's, then one per sampled token): it has sampled
    two tokens when the abort lands, and the generation checks for an abort before sampling the third."""
    model = cpu_utils.tiny_qwen2()
    gated = _GatedModel(model, pause_at=3)
    server = _server(gated, response_length=8, ignore_eos=True)
    prompts = [list(r.prompt_ids) for r in _requests([3, 6, 4])]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def scenario():
        running = [asyncio.create_task(server.generate(str(i), p, greedy)) for i, p in enumerate(prompts[:2])]
        assert await asyncio.to_thread(gated.reached.wait, 120), "the batch never reached its third forward pass"
        waiting = asyncio.create_task(server.generate("w", prompts[2], greedy))
        await asyncio.sleep(0)  # the request queues behind the running batch
        assert [p.request.prompt_ids for p in server._pending] == [tuple(prompts[2])]
        abort = asyncio.create_task(server.abort_all_requests())
        await asyncio.sleep(0)  # the abort answers the waiting request, flags the batch, waits for it to stop
        assert server._pending == [] and server._aborting
        gated.release.set()
        report = await abort
        held = asyncio.create_task(server.generate("h", prompts[2], greedy))
        for _ in range(3):  # let it run as far as it can: to the resume gate, never into the queue
            await asyncio.sleep(0)
        held_before_resume = held.done() or bool(server._pending)
        await server.resume_generation()
        return report, await asyncio.gather(*running), await waiting, held_before_resume, await held

    report, running, waiting, held_before_resume, held = asyncio.run(scenario())
    full = generate_batch(model, _requests([3, 6, 4], max_tokens=8), [], cpu_utils.PAD_ID)
    assert report["aborted_count"] == 1 and waiting.stop_reason == "aborted" and waiting.token_ids == []
    for out, reference in zip(running, full):
        assert out.stop_reason == "aborted" and out.token_ids == reference.token_ids[:2]
        assert out.log_probs == pytest.approx(reference.log_probs[:2], abs=1e-5)
    assert server.batch_sizes == [2, 1], "the running batch and, after resume, the held request"
    assert not held_before_resume
    assert held.stop_reason == "completed" and held.token_ids == full[2].token_ids


def test_server_weight_load_is_exact_and_complete():
    server = _server(cpu_utils.tiny_qwen2(seed=0))
    source = cpu_utils.tiny_qwen2(seed=1)
    named = dict(source.named_parameters())
    names = sorted(named)

    async def sync(parts):
        for i, part in enumerate(parts):
            await server.load_weights({n: named[n].detach() for n in part}, global_steps=7, last=i == len(parts) - 1)

    asyncio.run(sync([names[:5], names[5:]]))
    target = server.model.state_dict()
    assert all(torch.equal(target[n], named[n]) for n in names) and server.global_steps == 7
    with pytest.raises(ValueError, match="sent no tensor"):
        asyncio.run(sync([names[1:]]))
    with pytest.raises(KeyError, match="does not have"):
        asyncio.run(server.load_weights({"model.no_such.weight": torch.zeros(1)}))


def test_tied_embeddings_count_as_synced_through_either_name():
    model = cpu_utils.tiny_qwen2(tie_word_embeddings=True)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {"lm_head.weight"}
    assert server_module._unsynced_parameters(model, names) == set()
    assert server_module._unsynced_parameters(model, names - {"model.norm.weight"}) == {"model.norm.weight"}


# ==================================================================================================
# the prefix cache: a request that continues a finished reply starts from its cache


def _cache_entry(tokens, layers=2, heads=2, dim=3):
    kv = [(torch.randn(heads, len(tokens), dim), torch.randn(heads, len(tokens), dim)) for _ in range(layers)]
    return kv


def test_prefix_cache_finds_a_finished_row_that_holds_all_of_a_prompt_but_its_last_token():
    cache = PrefixCache(max_tokens=100)
    prompt, reply = (5, 6, 7), (8, 9, 10, 11)
    kv = _cache_entry(prompt + reply[:-1])
    cache.add(prompt, prompt + reply[:-1], kv)
    branch = cache.lookup(prompt + reply[:2])  # a branch at the parent's third token: tokens 5 6 7 8 held
    assert branch is not None and len(branch) == 2
    assert torch.equal(branch[0][0], kv[0][0][:, :4]) and torch.equal(branch[1][1], kv[1][1][:, :4])
    assert cache.lookup(prompt + reply) is not None, "the next piece of the same reply (all 6 held tokens)"
    assert cache.lookup(prompt) is not None, "the same prompt again"
    assert cache.lookup(prompt + reply + (12,)) is None, "one token more than the row holds"
    assert cache.lookup((5, 6, 9, 8)) is None, "parts from the row inside the prompt"
    assert cache.lookup((5,)) is None, "a one-token prompt has nothing to reuse"
    assert (cache.hits, cache.misses, cache.reused_tokens) == (3, 3, 4 + 6 + 2)


def test_prefix_cache_keeps_at_most_max_tokens_dropping_the_least_recently_used_row():
    cache = PrefixCache(max_tokens=10)
    rows = [(1, 2, 3, 4), (1, 5, 6, 7), (1, 8, 9, 10)]
    for row in rows[:2]:
        cache.add(row[:2], row, _cache_entry(row))
    assert cache.lookup(rows[0] + (0,)) is not None  # the first row is now the most recently used
    cache.add(rows[2][:2], rows[2], _cache_entry(rows[2]))
    assert len(cache) == 2 and cache.tokens == 8
    assert cache.lookup(rows[1] + (0,)) is None and cache.lookup(rows[0] + (0,)) is not None
    cache.add((1,), tuple(range(1, 12)), _cache_entry(tuple(range(1, 12))))
    assert len(cache) == 2, "a row longer than the whole cache is not kept"
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.lookup(rows[0] + (0,)) is None


def test_prefix_cache_refuses_a_row_whose_cache_does_not_match_its_tokens():
    with pytest.raises(ValueError, match="max_tokens=0"):
        PrefixCache(max_tokens=0)
    cache = PrefixCache(max_tokens=100)
    with pytest.raises(ValueError, match="columns per layer"):
        cache.add((1, 2), (1, 2, 3), _cache_entry((1, 2)))
    with pytest.raises(ValueError, match="start with prompt_ids"):
        cache.add((1, 2), (1, 3, 3), _cache_entry((1, 3, 3)))


def test_a_branch_of_a_finished_reply_skips_its_prefill_and_decodes_as_it_would_alone():
    """A parent reply finishes; a branch (its prompt plus the parent's first three reply tokens) and a fresh request
    join the batch while another row decodes. The branch enters from the parent's cache with its last prompt token
    fed in the decoding step (no prefill of its own), and every greedy reply and log-prob equals its unbatched
    run without a cache."""
    model = _WrappedModel(cpu_utils.tiny_qwen2())
    parent, other, fresh = _requests([5, 9, 4], max_tokens=6)
    cache = PrefixCache(max_tokens=1000)
    running = generation.RunningBatch(model, [], cpu_utils.PAD_ID, prefix_cache=cache)
    running.admit([("parent", parent), ("other", dataclasses.replace(other, max_tokens=12))])
    done = {}
    while "parent" not in done:
        done.update(running.step())
    assert len(cache) == 1 and cache.tokens == 5 + 6 - 1, "the parent's prompt and reply but its last token"
    branch = SamplingRequest(parent.prompt_ids + tuple(done["parent"].token_ids[:3]), max_tokens=6, temperature=0.0)
    shapes_before = len(model.shapes)
    running.admit([("branch", branch), ("fresh", fresh)])
    assert [shape for shape in model.shapes[shapes_before:]] == [(1, 4)], "only the fresh request is prefilled"
    assert len(running) == 3 and running.keys() == ["other", "fresh", "branch"]
    while len(running):
        done.update(running.step())
    assert all(shape[1] == 1 for shape in model.shapes[shapes_before + 1:]), "the branch entered in a decoding step"
    assert (cache.hits, cache.reused_tokens) == (1, len(branch.prompt_ids) - 1)
    for key, request in {"parent": parent, "branch": branch, "fresh": fresh,
                         "other": dataclasses.replace(other, max_tokens=12)}.items():
        alone = generate_batch(model.model, [request], [], cpu_utils.PAD_ID)[0]
        assert done[key].token_ids == alone.token_ids, key
        assert done[key].log_probs == pytest.approx(alone.log_probs, abs=1e-5), key


def test_a_branch_enters_an_empty_batch_from_the_cache():
    model = _WrappedModel(cpu_utils.tiny_qwen2())
    parent = _requests([6], max_tokens=5)[0]
    cache = PrefixCache(max_tokens=1000)
    running = generation.RunningBatch(model, [], cpu_utils.PAD_ID, prefix_cache=cache)
    running.admit([("parent", parent)])
    first = dict(running.step())
    while not first:
        first = dict(running.step())
    branch = SamplingRequest(parent.prompt_ids + tuple(first["parent"].token_ids[:2]), max_tokens=4, temperature=0.0)
    calls = model.calls
    running.admit([("branch", branch)])
    assert model.calls == calls and len(running) == 1 and running.accepts_joins()
    done = {}
    while len(running):
        done.update(running.step())
    alone = generate_batch(model.model, [branch], [], cpu_utils.PAD_ID)[0]
    assert done["branch"].token_ids == alone.token_ids
    assert done["branch"].log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    assert model.calls - calls == 4, "one decoding step per token (the last sampled token is never fed)"


def test_requests_with_one_prompt_are_prefilled_once_and_an_abort_returns_cache_hits_empty():
    model = _WrappedModel(cpu_utils.tiny_qwen2())
    first, second = _requests([5, 7], max_tokens=4)
    cache = PrefixCache(max_tokens=1000)
    running = generation.RunningBatch(model, [], cpu_utils.PAD_ID, prefix_cache=cache)
    running.admit([(0, first), (1, second), (2, first), (3, first)])
    assert model.shapes == [(2, 7)], "two distinct prompts, one prefill row each"
    done = {}
    while len(running):
        done.update(running.step())
    for key, request in enumerate([first, second, first, first]):
        alone = generate_batch(model.model, [request], [], cpu_utils.PAD_ID)[0]
        assert done[key].token_ids == alone.token_ids and done[key].log_probs == pytest.approx(alone.log_probs,
                                                                                                abs=1e-5), key
    running.admit([("again", first)])  # the finished rows hold the prompt: a cache hit, not yet in a step
    assert running.keys() == ["again"]
    stopped = running.step(should_abort=lambda: True)
    assert stopped[0][0] == "again" and stopped[0][1].aborted and stopped[0][1].token_ids == []
    assert len(running) == 0


def test_server_prefix_cache_follows_the_rollout_config_and_is_emptied_at_every_weight_load():
    server = _server(cpu_utils.tiny_qwen2(seed=0), prompt_length=32, response_length=6, max_num_seqs=4)
    assert server.prefix_cache is not None and server.prefix_cache.max_tokens == 4 * (32 + 6)
    assert _server(cpu_utils.tiny_qwen2(), enable_prefix_caching=False).prefix_cache is None
    request = _requests([5])[0]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1}

    async def twice():
        first = await server.generate("a", list(request.prompt_ids), greedy)
        await server.generate("b", list(request.prompt_ids) + list(first.token_ids[:2]), greedy)
        return await server.stats()

    stats = asyncio.run(twice())
    assert stats["prefix_hits"] == 1 and stats["prefix_reused_tokens"] == 5 + 2 - 1 and len(server.prefix_cache)
    named = {n: p.detach() for n, p in cpu_utils.tiny_qwen2(seed=1).named_parameters()}
    asyncio.run(server.load_weights(named, global_steps=1))
    assert len(server.prefix_cache) == 0, "keys and values of the old weights must not continue a reply"


# ==================================================================================================
# weight sync through Ray, as in a run


@pytest.mark.slow
def test_adapter_weight_sync_after_an_actor_update_is_exact(local_ray, tmp_path):
    """An actor takes an optimizer step; the adapter (as in the actor worker) sends its weights in several
    buckets to the replica's named server actor; the server's weights then equal the actor's exactly."""
    from verl.workers.config import RolloutConfig

    actor = cpu_utils.save_tiny_qwen2(str(tmp_path))
    model_config = OmegaConf.create({"path": str(tmp_path), "override_config": {"attn_implementation": "sdpa"}})
    config = OmegaConf.create({"prompt_length": 32, "response_length": 4, "seed": 0, "max_num_seqs": 16})
    server = local_ray.remote(HFRolloutServer).options(name=server_actor_name(0), num_cpus=0).remote(
        config=config, model_config=model_config)
    before = local_ray.get(server.state_dict.remote())
    actor.train()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    tokens = torch.tensor([[2, 3, 4, 5, 6, 7]])
    actor(tokens, labels=tokens).loss.backward()
    optimizer.step()

    adapter = HFRolloutAdapter(RolloutConfig(name="hf", tensor_model_parallel_size=1), None, None)
    assert adapter.is_leader_rank and adapter.replica_rank == 0
    adapter.bucket_bytes = 20_000  # several buckets
    asyncio.run(adapter.update_weights(iter(list(actor.named_parameters())), global_steps=3))
    served = local_ray.get(server.state_dict.remote())
    expected = actor.state_dict()
    assert any(not torch.equal(before[n], expected[n]) for n in expected), "the update changed nothing"
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[n], expected[n]) for n in expected)
    assert local_ray.get(server.stats.remote())["global_steps"] == 3
    local_ray.kill(server)


# ==================================================================================================
# sampler.py: verl's replay buffer with a short poll interval


def _sampler_kwargs(mode: str, sampler_kwargs=None) -> dict:
    return dict(trainer_mode=mode, trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
                max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create(sampler_kwargs or {}),
                refill_fn=lambda n: None)


@pytest.mark.parametrize("mode, expected", [("sync", "ReplayBuffer"), ("colocate_async", "ReplayBufferAsync"),
                                            ("separate_async", "ReplayBufferAsync")])
def test_replay_buffer_is_verls_own_for_the_mode_with_a_short_poll(mode, expected):
    kwargs = _sampler_kwargs(mode)
    buffer = sampler.replay_buffer(**kwargs)
    assert type(buffer).__name__ == expected and type(buffer).__module__ == "verl.trainer.ppo.v1.replay_buffer"
    assert buffer.poll_interval == sampler.DEFAULT_POLL_INTERVAL_S == 0.2
    assert buffer.trainer_mode == mode and buffer.refill_fn is kwargs["refill_fn"]


def test_replay_buffer_poll_interval_from_sampler_kwargs():
    assert sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": 0.5})).poll_interval == 0.5
    assert sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": 1})).poll_interval == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True, None])
def test_replay_buffer_rejects_a_bad_poll_interval(bad):
    with pytest.raises(ValueError, match="sampler_kwargs.poll_interval"):
        sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": bad}))


def test_replay_buffer_needs_the_trainer_mode():
    kwargs = _sampler_kwargs("sync")
    del kwargs["trainer_mode"]
    with pytest.raises(TypeError, match="trainer_mode"):
        sampler.replay_buffer(**kwargs)
