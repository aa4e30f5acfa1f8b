#!/usr/bin/env bash
# Shared launcher for the Qwen2.5-Instruct GSM8K examples (GROUP-PPO and its GAE / GRPO baselines).
#
#   bash examples/group_ppo_trainer/common.sh SIZE ESTIMATOR [extra Hydra overrides...]
#
#   SIZE       0.5b | 1.5b | 3b | 7b          (picks model, GPU count, batch sizes)
#   ESTIMATOR  group_ppo | group_ppo_mc | group_ppo_tree | gae | grpo
#
# The run_qwen2_5-*_gsm8k*.sh scripts next to this file call it with fixed SIZE and ESTIMATOR (the *_multiturn*
# ones with MULTI_TURN=1).
# Extra arguments are appended after every setting below, so they win (Hydra keeps the last value
# given for a key), e.g.  trainer.total_epochs=1  'trainer.logger=[console,tensorboard,file,wandb]'
#
# Environment:
#   MULTI_TURN  1: tool calling through verl's tool agent loop (multi_turn.enable, agent loop tool_agent, the
#               `calculate` function tool of calculator_tool.py next to this file, verl's hermes format, up to
#               5 assistant turns, tool replies of at most 256 characters); the data from
#               `examples/data_preprocess/gsm8k.py --multi-turn`. Default 0: single-turn
#   DATA_DIR    where examples/data_preprocess/gsm8k.py wrote train/test.parquet (default ~/data/gsm8k,
#               with MULTI_TURN=1 ~/data/gsm8k_multiturn)
#   MODEL_PATH  model for actor and critic (default: the Hugging Face Qwen2.5-<SIZE>-Instruct id)
#   OUT_DIR     where logs and checkpoints go (default ./outputs), per run:
#                 OUT_DIR/verl_group_ppo_gsm8k/<experiment>.jsonl        every metric, group/* included
#                 OUT_DIR/verl_group_ppo_gsm8k/<experiment>/tensorboard  the same, for TensorBoard
#                 OUT_DIR/verl_group_ppo_gsm8k/<experiment>/checkpoints  every 50 steps and at the end;
#                                                                        verl prunes the actor/ and critic/
#                                                                        folders to the last two saves of
#                                                                        a run (docs/reproducing.md)
#   PYTHON      interpreter that has verl and verl-group-ppo installed (default python3)
#
# Logging needs no account (verl's file logger and TensorBoard; tensorboard comes with verl and this
# package). Weights & Biases in addition: 'trainer.logger=[console,tensorboard,file,wandb]'.
#
# The three estimators share every setting except these (and only because the estimator needs it):
#   group_ppo  algorithm.adv_estimator=group_ppo, critic.enable=True, trainer.critic_warmup=21 (20
#              critic-only steps) and ++algorithm.group_params.group_max_size=32; every other
#              algorithm.group_params key takes its package default (verl_group_ppo.config.GroupParams,
#              listed in docs/configuration.md)
#   group_ppo_mc  algorithm.adv_estimator=group_ppo with ++algorithm.group_params.value_source=mc,
#              mc_samples=4 and group_max_size=64: boundary values from 4 continuations per group start, no
#              critic (critic.enable=False, no warm-up), no KL
#   group_ppo_tree  algorithm.adv_estimator=group_ppo over a tree rollout: a prompt's rollout.n=8 replies
#              sampled as one tree (agent loop tree_single_turn, tree_rollout roots=2, branching=[2,2],
#              segment_tokens=64), prefix_tree values, groups cut at the tree's branch points
#              (boundary_rule=tree) and policy_lam=0 (each segment's V(child) - V(parent)); no critic, no KL
#   gae        algorithm.adv_estimator=gae, critic.enable=True, the same critic warm-up
#   grpo       algorithm.adv_estimator=grpo, critic.enable=False (GRPO has no critic, no warm-up), and the KL
#              to the reference policy as a loss term: actor.use_kl_loss=True, kl_loss_coef=0.001,
#              kl_loss_type=low_var_kl (GROUP-PPO and GAE run without KL, as verl's PPO examples do)
set -euo pipefail

usage() {
  # the header comment, without its leading '# '
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2
  exit 2
}
[ $# -ge 2 ] || usage
size=$1
estimator=$2
shift 2

# Per-size resources. Train batch (prompts) x n (responses per prompt) must divide by the GPU count;
# mini-batches are counted in prompts, micro-batches in responses per GPU.
case "$size" in
  0.5b) model=Qwen/Qwen2.5-0.5B-Instruct; n_gpus=2; rollout_tp=1; train_batch=256; mini_batch=64
        micro_batch=16; log_prob_micro_batch=32; gpu_mem=0.6; ref_offload=False ;;
  1.5b) model=Qwen/Qwen2.5-1.5B-Instruct; n_gpus=4; rollout_tp=1; train_batch=256; mini_batch=64
        micro_batch=8; log_prob_micro_batch=32; gpu_mem=0.6; ref_offload=False ;;
  3b)   model=Qwen/Qwen2.5-3B-Instruct; n_gpus=8; rollout_tp=2; train_batch=512; mini_batch=128
        micro_batch=8; log_prob_micro_batch=16; gpu_mem=0.5; ref_offload=True ;;
  7b)   model=Qwen/Qwen2.5-7B-Instruct; n_gpus=8; rollout_tp=2; train_batch=512; mini_batch=128
        micro_batch=4; log_prob_micro_batch=16; gpu_mem=0.5; ref_offload=True ;;
  *) echo "common.sh: unknown SIZE '$size' (expected 0.5b, 1.5b, 3b or 7b)" >&2; exit 2 ;;
esac

MULTI_TURN=${MULTI_TURN:-0}
case "$MULTI_TURN" in
  0) DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}; turns="" ;;
  1) DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k_multiturn}; turns="_multiturn" ;;
  *) echo "common.sh: MULTI_TURN='$MULTI_TURN' must be 0 or 1" >&2; exit 2 ;;
esac
MODEL_PATH=${MODEL_PATH:-$model}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-$PWD/outputs}
case "$OUT_DIR" in /*) ;; *) OUT_DIR=$PWD/$OUT_DIR ;; esac  # absolute: Ray workers do not share our cwd
project=verl_group_ppo_gsm8k
experiment="qwen2_5-${size}_gsm8k${turns}_${estimator}"
# Responses sampled per prompt: GRPO needs n > 1; every estimator uses the same n, except the tree's, whose n is
# its shape's size (roots * prod(branching) = 2 * 2 * 2)
rollout_n=5
if [ "$estimator" = group_ppo_tree ]; then rollout_n=8; fi

shared=(
  data.train_files="$DATA_DIR/train.parquet"
  data.val_files="$DATA_DIR/test.parquet"
  data.train_batch_size=$train_batch
  data.max_prompt_length=512
  data.max_response_length=1024
  data.filter_overlong_prompts=True
  data.truncation=error
  algorithm.gamma=1.0
  algorithm.lam=1.0
  algorithm.use_kl_in_reward=False
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=$mini_batch
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$micro_batch
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=$rollout_n
  actor_rollout_ref.rollout.tensor_model_parallel_size=$rollout_tp
  actor_rollout_ref.rollout.gpu_memory_utilization=$gpu_mem
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$log_prob_micro_batch
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$log_prob_micro_batch
  actor_rollout_ref.ref.fsdp_config.param_offload=$ref_offload
  critic.model.path="$MODEL_PATH"
  critic.model.use_remove_padding=True
  critic.model.enable_gradient_checkpointing=True
  critic.optim.lr=1e-5
  critic.ppo_micro_batch_size_per_gpu=$micro_batch
  'trainer.logger=[console,tensorboard,file]'
  ++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_ROOT="$OUT_DIR"
  ++ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR="$OUT_DIR/$project/$experiment/tensorboard"
  trainer.project_name=$project
  trainer.experiment_name="$experiment"
  trainer.n_gpus_per_node=$n_gpus
  trainer.nnodes=1
  trainer.val_before_train=True
  trainer.test_freq=10
  trainer.save_freq=50
  trainer.max_actor_ckpt_to_keep=2
  trainer.max_critic_ckpt_to_keep=2
  trainer.default_local_dir="$OUT_DIR/$project/$experiment/checkpoints"
  trainer.total_epochs=15
)

case "$estimator" in
  group_ppo)
    specific=(
      algorithm.adv_estimator=group_ppo
      critic.enable=True
      actor_rollout_ref.actor.use_kl_loss=False
      # Critic warm-up: 20 critic-only steps (verl gives N - 1 for critic_warmup=N), the same for gae, so
      # that the actor's first updates use a critic fitted to this model (about 5% of this run's steps;
      # verl's default is 0).
      trainer.critic_warmup=21
      # Only the group_params that differ from the package defaults (GroupParams; docs/configuration.md).
      # group_max_size=32, not 16: with tau up to max_threshold=10, a cap of 16 ends about a fifth of the
      # groups of a long response and 32 almost none, so the critic, not the cap, decides where groups end
      # (docs/configuration.md, "group_max_size"; benchmarks/bench_long_cot.py).
      ++algorithm.group_params.group_max_size=32
    ) ;;
  group_ppo_mc)
    specific=(
      algorithm.adv_estimator=group_ppo
      # boundary values from Monte Carlo continuations instead of a critic (docs/algorithm.md, "Value
      # sources"): K=4 continuations from each group start, sampled by the vLLM rollout; no critic worker, so
      # nothing to warm up
      ++algorithm.group_params.value_source=mc
      ++algorithm.group_params.mc_samples=4
      # groups of at most 64 tokens (the fixed rule, mc's default): about a quarter of a GSM8K reply, so most
      # of a reply's outcome is decided at inner boundaries (the tiny task's headroom table, docs/results.md)
      ++algorithm.group_params.group_max_size=64
      critic.enable=False
      trainer.critic_warmup=0
      actor_rollout_ref.actor.use_kl_loss=False
    ) ;;
  group_ppo_tree)
    specific=(
      algorithm.adv_estimator=group_ppo
      # a prompt's replies sampled as one tree (docs/algorithm.md, "Tree rollouts"): 2 roots, then two levels
      # where every reply is joined by one more sharing its first 64 and 128 tokens; each samples only its tail
      actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn
      ++tree_rollout.roots=2
      ++tree_rollout.branching=[2,2]
      ++tree_rollout.segment_tokens=64
      # the tree's values (mean reward of the replies below each node), groups = the tree's segments, and each
      # segment's advantage V(child) - V(parent); no critic worker, so nothing to warm up
      ++algorithm.group_params.value_source=prefix_tree
      ++algorithm.group_params.boundary_rule=tree
      ++algorithm.group_params.policy_lam=0.0
      critic.enable=False
      trainer.critic_warmup=0
      actor_rollout_ref.actor.use_kl_loss=False
    ) ;;
  gae)
    specific=(
      algorithm.adv_estimator=gae
      critic.enable=True
      # the same critic warm-up as group_ppo (20 critic-only steps); lambda stays algorithm.lam=1.0, the
      # best single lambda for this critic in the CPU demo's probe (docs/results.md)
      trainer.critic_warmup=21
      actor_rollout_ref.actor.use_kl_loss=False
    ) ;;
  grpo)
    specific=(
      algorithm.adv_estimator=grpo
      critic.enable=False
      trainer.critic_warmup=0  # no critic to warm up: the actor trains from the first step, as verl runs GRPO
      actor_rollout_ref.actor.use_kl_loss=True
      actor_rollout_ref.actor.kl_loss_coef=0.001
      actor_rollout_ref.actor.kl_loss_type=low_var_kl
    ) ;;
  *) echo "common.sh: unknown ESTIMATOR '$estimator' (expected group_ppo, group_ppo_mc, group_ppo_tree, gae or grpo)" >&2; exit 2 ;;
esac

# Tool calling: the tool replies sit in the response with response_mask 0 (GROUP-PPO ends a group at every
# turn end and reads the critic right after each reply; docs/multiturn.md).
multi_turn=()
if [ "$MULTI_TURN" = 1 ]; then
  multi_turn=(
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
    actor_rollout_ref.rollout.multi_turn.format=hermes
    actor_rollout_ref.rollout.multi_turn.function_tool_path="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/calculator_tool.py"
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256
  )
fi

set -x
exec "$PYTHON" -m verl.trainer.main_ppo "${shared[@]}" "${specific[@]}" ${multi_turn[@]+"${multi_turn[@]}"} "$@"
