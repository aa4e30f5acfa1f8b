"""How GROUP-PPO's grouping and cost scale with response length (long chains of thought).

    .venv/bin/python benchmarks/bench_long_cot.py                       # the table in docs/configuration.md
    .venv/bin/python benchmarks/bench_long_cot.py --lengths 256,1024 --repeats 1 --json out.json

For each response length T (default 256, 1k, 4k, 8k tokens) it builds one synthetic batch of about
``--batch-tokens`` tokens (B = batch_tokens / T responses of exactly T tokens) for each critic, runs
``compute_group_ppo_outputs`` at several (group_max_size, tau) settings with tau fixed (adaptive_threshold
off: where a tau and a cap put the grouping, not how tau moves), and reports groups per response, mean group
size, the share of groups that stop at the cap, the boundary explained variance, and the median wall and
process-CPU time per batch next to verl's ``compute_gae_advantage_return`` on the same batch (timed
round-robin; the first critic's batches only: the cost does not depend on the values).

The synthetic task, per response ("decisive" tokens are where a reasoning step goes right or wrong):
  * a latent score x_t: x_0 ~ N(mu, 0.3^2) with mu ~ N(0, 0.8^2) shared by the 8 responses to one prompt; each
    token adds N(0, s_t^2): of the variance the tokens add (0.6 in all, whatever T), half evenly over all tokens,
    half on decisive tokens (one per 32 tokens on average, at random positions).
  * outcome reward R = 1 if x_T > 0 else 0, at the last token; true value V*_t = P(R = 1 | x_t) =
    Phi(x_t / sqrt(S_t)), S_t the variance still to come after token t.
  * critic values V_t = V*_t + noise in three equal-variance parts: a per-response offset, a slow drift (AR(1),
    64-token correlation length) and per-token jitter; total std 0.2 ("trained") or 0.3 ("weak"). "smooth" is
    std 0.2 without jitter: its TD residuals follow the true value's jumps at decisive tokens, where groups grow
    long and the cap matters. Their explained variances: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
from collections import namedtuple
from typing import Callable, NamedTuple

import numpy as np
import torch
from benchlib import time_round_robin, write_json

from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import GroupPPOOutputs, compute_group_ppo_outputs

RESPONSES_PER_PROMPT = 8
PROMPT_STD = 0.8  # spread of the latent score between prompts (difficulty)
START_STD = 0.3  # spread between responses to one prompt before the first token
STEP_VARIANCE = 0.6  # variance the tokens add, in all (half diffuse, half on decisive tokens)
DECISIVE_EVERY = 32  # tokens per decisive token, on average
DRIFT_LENGTH = 64.0  # correlation length of the critic's slow drift, in tokens


#: the critics' noise models: name -> (total std, whether it has per-token jitter)
CRITICS = {"trained": (0.2, True), "weak": (0.3, True), "smooth": (0.2, False)}


class Setting(NamedTuple):
    """One grouping setting: the cap on group size (None: the response length) and a fixed tau."""

    group_max_size: int | None
    tau: float

    def cap(self, length: int) -> int:
        """The cap in tokens for responses of ``length`` tokens."""
        return length if self.group_max_size is None else self.group_max_size

    def label(self) -> str:
        """How the setting is named in the table."""
        cap = "T" if self.group_max_size is None else str(self.group_max_size)
        return f"cap {cap}, tau {self.tau:g}"


SETTINGS = (Setting(16, 1.0), Setting(16, 10.0), Setting(32, 10.0), Setting(64, 10.0), Setting(None, 10.0),
            Setting(None, 100.0), Setting(None, 1000.0))


#: one line of the result table (and one record of ``--json``); times are per batch, NaN when not timed
Row = namedtuple("Row", "length responses critic setting groups_per_response mean_group_size capped_share "
                        "boundary_ev seconds cpu_seconds gae_seconds gae_cpu_seconds")


def true_values(batch: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent-score task: (V*, R), both (B, T) float32; V*[:, t] = P(success | tokens before t), R the outcome
    (1 or 0 at the last token, 0 elsewhere). See the module docstring."""
    prompts = math.ceil(batch / RESPONSES_PER_PROMPT)
    mu = (PROMPT_STD * torch.randn(prompts, generator=g)).repeat_interleave(RESPONSES_PER_PROMPT)[:batch]
    decisive = torch.rand(batch, length, generator=g) < 1.0 / DECISIVE_EVERY
    per_token = torch.full((batch, length), 0.5 * STEP_VARIANCE / length)
    per_token += decisive * (0.5 * STEP_VARIANCE / decisive.sum(1, keepdim=True).clamp(min=1))
    x0 = mu + START_STD * torch.randn(batch, generator=g)
    x = x0[:, None] + torch.cumsum(per_token.sqrt() * torch.randn(batch, length, generator=g), dim=1)
    # values[t] is the state before token t: score and remaining variance before the increment at t.
    before = torch.cat([x0[:, None], x[:, :-1]], dim=1)
    remaining = torch.flip(torch.cumsum(torch.flip(per_token, [1]), 1), [1])
    v_star = torch.special.ndtr(before / remaining.sqrt())
    reward = torch.zeros(batch, length)
    reward[:, -1] = (x[:, -1] > 0).float()
    return v_star, reward


def critic_noise(batch: int, length: int, std: float, jitter: bool, g: torch.Generator) -> torch.Tensor:
    """(B, T) noise: per-response offset + AR(1) drift (+ per-token jitter), equal variances summing to std^2."""
    part = std / math.sqrt(3.0 if jitter else 2.0)
    rho = math.exp(-1.0 / DRIFT_LENGTH)
    shocks = torch.randn(batch, length, generator=g, dtype=torch.float64) * math.sqrt(1 - rho**2)
    shocks[:, 0] = torch.randn(batch, generator=g, dtype=torch.float64)  # stationary start
    powers = rho ** torch.arange(length, dtype=torch.float64)
    # AR(1) u_t = rho u_{t-1} + e_t as a scaled cumulative sum; rho^-t stays finite in float64 up to
    # t ~ 700 * DRIFT_LENGTH tokens.
    if length > 600 * DRIFT_LENGTH:
        raise ValueError(f"--lengths: {length} is too long for the drift model (at most {600 * DRIFT_LENGTH:g})")
    drift = powers * torch.cumsum(shocks / powers, dim=1)
    offset = torch.randn(batch, 1, generator=g)
    noise = torch.randn(batch, length, generator=g) if jitter else torch.zeros(batch, length)
    return part * (offset + drift.float() + noise)


def make_batch(length: int, batch_tokens: int, critic: str, seed: int) -> dict:
    """One synthetic batch with ``critic``'s values: rewards, values, mask (all (B, T) float32) and prompt ids (B,)."""
    g = torch.Generator().manual_seed(seed)
    batch = max(RESPONSES_PER_PROMPT, batch_tokens // length)
    v_star, rewards = true_values(batch, length, g)
    values = v_star + critic_noise(batch, length, *CRITICS[critic], g)
    index = np.array([f"p{i // RESPONSES_PER_PROMPT}" for i in range(batch)], dtype=object)
    return {"rewards": rewards, "values": values, "mask": torch.ones(batch, length), "index": index}


def measure_length(length: int, critic: str, args: argparse.Namespace) -> list[Row]:
    """Every setting at one response length and one critic."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    x = make_batch(length, args.batch_tokens, critic, seed=args.seed)
    calls: dict[str, Callable[[], object]] = {
        "gae": lambda: compute_gae_advantage_return(x["rewards"], x["values"], x["mask"], 1.0, 1.0)}
    for s in SETTINGS:
        settings = read_algorithm_settings({"gamma": 1.0, "lam": 1.0, "group_params": {
            "group_max_size": s.cap(length), "group_variance_threshold": s.tau, "adaptive_threshold": False}})
        calls[s.label()] = (lambda st=settings: compute_group_ppo_outputs(
            x["rewards"], x["mask"], values=x["values"], settings=st, index=x["index"]))
    timed = critic == args.critics.split(",")[0]  # the cost does not depend on the values: time one critic
    results, seconds = time_round_robin(calls, args.repeats if timed else 0)
    rows = []
    for s in SETTINGS:
        out = results[s.label()]
        rows.append(Row(length, len(x["index"]), critic, s.label(), out.metrics["group/groups_per_response"],
                        out.mean_group_size, capped_share(out, s.cap(length)), out.boundary_explained_variance,
                        *seconds[s.label()], *seconds["gae"]))
    return rows


def capped_share(out: GroupPPOOutputs, cap: int) -> float:
    """Share of groups whose size equals the cap (they stopped at ``group_max_size``, or hit it exactly);
    NaN when the cap is the whole response."""
    if cap >= out.critic_mask.shape[1]:
        return math.nan
    starts = torch.nonzero(out.critic_mask.reshape(-1)).squeeze(1)  # groups in order, row by row
    ends = torch.nonzero(out.endpoint_mask.reshape(-1)).squeeze(1)
    sizes = ends - starts + 1
    return float((sizes == cap).float().mean()) if len(sizes) else math.nan


def print_table(rows: list[Row]) -> None:
    """The rows as a Markdown table (blank times: not timed)."""
    print("| T | responses | critic | setting | groups / response | mean group size | at cap | boundary EV "
          "| wall s / batch (verl GAE) | CPU s / batch (verl GAE) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [str(r.length), str(r.responses), r.critic, r.setting, f"{r.groups_per_response:.1f}",
                 f"{r.mean_group_size:.1f}", "-" if math.isnan(r.capped_share) else f"{r.capped_share:.0%}",
                 f"{r.boundary_ev:.2f}", _pair(r.seconds, r.gae_seconds), _pair(r.cpu_seconds, r.gae_cpu_seconds)]
        print("| " + " | ".join(cells) + " |")


def _pair(ours: float, gae: float) -> str:
    return "" if math.isnan(ours) else f"{ours:.2f} ({gae:.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,1024,4096,8192", help="comma-separated response lengths T")
    p.add_argument("--batch-tokens", type=int, default=2**18, help="tokens per batch (B = this / T)")
    p.add_argument("--critics", default=",".join(CRITICS), help=f"subset of {','.join(CRITICS)}")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per setting (median reported), first critic only")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    for length in (int(t) for t in args.lengths.split(",")):
        for critic in args.critics.split(","):
            rows.extend(measure_length(length, critic, args))
    print_table(rows)
    if args.json:
        write_json(args.json, [r._asdict() for r in rows])


if __name__ == "__main__":
    main()
