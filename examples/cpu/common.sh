#!/usr/bin/env bash
# Shared launcher for the tiny CPU examples: verl's real `python -m verl.trainer.main_ppo` on a CPU-only
# machine (no GPU, 2 cores are enough), or on GPUs with DEVICE=cuda, with GROUP-PPO or its GAE / GRPO baselines.
#
#   bash examples/cpu/common.sh ESTIMATOR [extra Hydra overrides...]
#
#   ESTIMATOR  group_ppo | gae | grpo
#
# The run_tiny_*.sh scripts next to this file call it with a fixed ESTIMATOR (run_tiny_multiturn_*.sh with
# MULTI_TURN=1). Extra arguments are
# appended after every setting below, so they win (Hydra keeps the last value given for a key), e.g.
#   trainer.total_training_steps=10   ++algorithm.group_params.critic_loss_on=all_tokens
#   actor_rollout_ref.rollout.name=vllm   (verl's own vLLM rollout on vLLM's CPU build instead of the backend's
#                                          hf rollout; the backend sets what vLLM needs on a CPU, docs/cpu.md)
#
# Environment:
#   TASK      tiny (default): the tiny task (a 0.56M-parameter model built by tasks.tiny.prepare); arith: the
#             maths-question task's arithmetic variant (two- and three-step integer questions, free-form answers,
#             one data source per module) answered by a pretrained LM, by default SmolLM2-135M-Instruct (4-bit GGUF
#             weights converted once; docs/mathtask.md); twoway: the same model on DeepMind's two-way questions
#             (True/False, which is bigger), which measures the answer format
#   MULTI_TURN  1: the tiny tool task through verl's tool agent loop (multi_turn.enable, the `tool_agent`
#             loop, the `add` function tool and the `tinycalc` call format; responses of up to 96 tokens,
#             tool replies masked); default 0: the single-turn task
#   Each task's numbers (prompt and reply length, prompts per step, responses per prompt, steps, learning rates,
#   mini-batches, validation, threads, WORK_DIR) are its spec's: `python -m verl_group_ppo.tasks.launcher shell TASK
#   MULTI_TURN` prints them as the variables this script reads in its one list of settings.
#   WORK_DIR  the task's directory (default: the spec's, under the repository root: runs/cpu-tiny,
#             runs/cpu-tiny-tools with MULTI_TURN=1, runs/cpu-arith, runs/cpu-twoway). Every run first calls the task's
#             prepare (`python -m verl_group_ppo.tasks.tiny.prepare [--variant tools]` or
#             `verl_group_ppo.tasks.maths.prepare` --output-dir WORK_DIR), which builds WORK_DIR/model and
#             WORK_DIR/data/{train,test}.parquet and its key file WORK_DIR/data/prepare.json (minutes), and does nothing (seconds) when the key file
#             holds the same settings. With MULTI_TURN=1 and actor_rollout_ref.rollout.name=vllm the default is
#             runs/cpu-tiny-tools-small, the tool task on the `small` model (`prepare --variant tools --model-size
#             small`): the tool task's `tiny` model has attention heads of 16 dimensions, which vLLM's CPU
#             attention does not serve
#   PREPARE   0: use WORK_DIR as it is, without calling prepare (a task prepared with other settings, e.g.
#             from Python); default 1
#   PYTHON    interpreter with verl and verl-group-ppo (default: the repository's .venv/bin/python
#             when present, else python3)
#   VALUE_SOURCE  group_ppo only: critic (default), mc or prefix_tree, as ++algorithm.group_params.value_source
#             (docs/algorithm.md, "Value sources"); MC_SAMPLES: ++algorithm.group_params.mc_samples (K, mc only).
#             With mc or prefix_tree (set either way) groups are the fixed rule's, of the spec's value_group_size
#             tokens (4), unless an override sets group_max_size or boundary_rule
#   ROLLOUT   independent (default): a prompt's rollout.n replies sampled independently; tree: sampled as one tree
#             by the tree_single_turn agent loop (docs/algorithm.md, "Tree rollouts"): the tree_rollout keys
#             roots = rollout.n / 4 and branching = [2, 2] when rollout.n is a multiple of 4 and at least 8, else
#             roots = rollout.n / 2 and branching = [2] (at least two roots, so the first segment has a baseline),
#             segment_tokens = the spec's value_group_size, each unless an override sets it (roots and branching
#             together: an override of either leaves both to the overrides); with
#             group_ppo and the prefix_tree value source also boundary_rule=tree and policy_lam=0 (each segment's
#             advantage V(child) - V(parent)) unless an override sets them. Not with MULTI_TURN=1
#   NICE      nice level of the run (default 5: the run yields to interactive work)
#   DEVICE    cpu (default): the CPU backend (VERL_PLATFORM=cpu, trainer.device=cpu, 8 logical Ray CPUs, the
#             spec's threads). cuda: verl on GPUs, the same tasks and settings otherwise: no VERL_PLATFORM
#             (an inherited one is unset), trainer.device=cuda, Ray's CPUs = `nproc`, threads per process =
#             nproc / (N_RANKS + 2) (the ranks, the driver and the hf rollout server), at least 1; the hf rollout
#             generates on the GPU and the critic loads with sdpa, so neither vLLM nor flash-attn is needed
#   N_RANKS   trainer ranks (CPU processes or GPUs, one per "GPU" verl sees; default 1): sets trainer.n_gpus_per_node
#             and ++ray_kwargs.ray_init.num_gpus; must divide the task's smallest mini-batch in responses (64
#             for the tiny task, 32 for arith and twoway), and the per-rank micro-batch becomes min(32, that / N_RANKS)
#             responses so every mini-batch divides
#
# Settings the launcher leaves out when an extra override sets them, by key (a leading +, ++ or ~ is
# ignored; only the key before = counts, never the value):
#   algorithm.filter_groups.*, trainer.v1.sampler.sync_refill_failed_groups,
#   trainer.v1.sampler.custom_sampler.*   -> no short-poll sampler (verl's own replay buffer)
#   algorithm.rollout_correction.*        -> no bypass mode (verl recomputes the old log-probs)
#
# Checkpoint: saved after the last step under WORK_DIR/checkpoints/ESTIMATOR/global_step_<N>/ (actor,
# critic, and GROUP-PPO's threshold); resume with  trainer.resume_mode=auto trainer.total_training_steps=<M>.
# Prints verl's per-step metrics (critic/score/mean is the training reward, timing_s/* the step breakdown).
#
# The three estimators share every setting except these (and only because the estimator needs it):
#   group_ppo  algorithm.adv_estimator=group_ppo, critic.enable=True (group_params at the package defaults);
#              with a critic-free value source (VALUE_SOURCE or ++algorithm.group_params.value_source=mc or
#              prefix_tree) critic.enable=False
#   gae        algorithm.adv_estimator=gae, critic.enable=True
#   grpo       algorithm.adv_estimator=grpo, critic.enable=False (GRPO has no critic)
# None of them uses a KL term (no reference model), as in the CPU demo.
set -euo pipefail

usage() {
  # the header comment: from line 2 to the first line that is not a comment
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}" >&2
  exit 2
}
[ $# -ge 1 ] || usage
estimator=$1
shift

# The keys the extra overrides set: `++a.b=1`, `+a.b=1`, `~a.b` and `a.b=1` all set key a.b.
override_keys=()
for arg in "$@"; do
  key=${arg#\~}; key=${key#++}; key=${key#+}
  override_keys+=("${key%%=*}")
done

# has_key KEY: true when an extra override sets exactly KEY.
has_key() {
  local k
  for k in ${override_keys[@]+"${override_keys[@]}"}; do [ "$k" = "$1" ] && return 0; done
  return 1
}

# has_key_prefix PREFIX: true when an extra override sets PREFIX itself or a key under it (PREFIX.*).
has_key_prefix() {
  local k
  for k in ${override_keys[@]+"${override_keys[@]}"}; do
    case "$k" in "$1" | "$1".*) return 0 ;; esac
  done
  return 1
}
# override_value KEY: the value the last extra override gives KEY (empty when none sets it).
override_value() {
  local arg key value=""
  for arg in ${extra_args[@]+"${extra_args[@]}"}; do
    key=${arg#\~}; key=${key#++}; key=${key#+}
    [ "${key%%=*}" = "$1" ] && value=${key#*=}
  done
  printf '%s' "$value"
}
extra_args=("$@")
case "$estimator" in
  group_ppo)
    # the value source: an extra override's, else VALUE_SOURCE's (set here only when no override sets it)
    value_source=$(override_value algorithm.group_params.value_source)
    specific=(algorithm.adv_estimator=group_ppo)
    if [ -z "$value_source" ] && [ -n "${VALUE_SOURCE:-}" ]; then
      value_source=$VALUE_SOURCE
      specific+=(++algorithm.group_params.value_source="$VALUE_SOURCE")
    fi
    if [ -n "${MC_SAMPLES:-}" ] && ! has_key algorithm.group_params.mc_samples; then
      specific+=(++algorithm.group_params.mc_samples="$MC_SAMPLES")
    fi
    # a critic only where it gives the boundary values (mc and prefix_tree run none, as grpo)
    if [ "${value_source:-critic}" = critic ]; then specific+=(critic.enable=True); else specific+=(critic.enable=False); fi
    ;;
  gae)       specific=(algorithm.adv_estimator=gae critic.enable=True) ;;
  grpo)      specific=(algorithm.adv_estimator=grpo critic.enable=False) ;;
  *) echo "common.sh: unknown ESTIMATOR '$estimator' (expected group_ppo, gae or grpo)" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TASK=${TASK:-tiny}
MULTI_TURN=${MULTI_TURN:-0}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PYTHON=$repo/.venv/bin/python; else PYTHON=python3; fi
fi
# The task's spec as shell variables (spec_name, default_work_dir, prepare_module, prepare_args, reward_path,
# project, prompt_length, response_length, train_batch, rollout_n, steps, actor_lr, critic_lr, actor_mini_batch,
# critic_mini_batch, rank_unit, val_before_train, test_freq, threads, max_assistant_turns, value_group_size;
# tool_file when multi-turn). A TASK or MULTI_TURN that names no task stops here.
spec=$("$PYTHON" -m verl_group_ppo.tasks.launcher shell "$TASK" "$MULTI_TURN") || exit 2
eval "$spec"
# mc and prefix_tree cut replies with the fixed rule at the spec's value_group_size tokens (the headroom benchmark:
# on the tiny task's ~11-token replies, groups of 4 leave 88% of the return variance to inner boundaries)
# ROLLOUT=tree: the tree agent loop and its shape; prefix_tree's groups are the tree's segments
ROLLOUT=${ROLLOUT:-independent}
tree=()
case "$ROLLOUT" in
  independent) ;;
  tree)
    tree=(actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn)
    if ! has_key tree_rollout && ! has_key tree_rollout.roots && ! has_key tree_rollout.branching; then
      if [ $((rollout_n % 4)) -eq 0 ] && [ "$rollout_n" -ge 8 ]; then tree_roots=$((rollout_n / 4)) tree_branching='[2,2]'
      elif [ $((rollout_n % 2)) -eq 0 ]; then tree_roots=$((rollout_n / 2)) tree_branching='[2]'
      else echo "common.sh: ROLLOUT=tree needs an even rollout.n (the $spec_name task's is $rollout_n)" >&2; exit 2; fi
      tree+=(++tree_rollout.roots=$tree_roots "++tree_rollout.branching=$tree_branching")
    fi
    has_key tree_rollout || has_key tree_rollout.segment_tokens \
      || tree+=(++tree_rollout.segment_tokens="$value_group_size")
    if [ "$estimator" = group_ppo ] && [ "${value_source:-critic}" = prefix_tree ]; then
      has_key algorithm.group_params.boundary_rule || specific+=(++algorithm.group_params.boundary_rule=tree)
      has_key algorithm.group_params.policy_lam || specific+=(++algorithm.group_params.policy_lam=0.0)
    fi
    ;;
  *) echo "common.sh: ROLLOUT='$ROLLOUT' must be independent or tree" >&2; exit 2 ;;
esac
if [ "$estimator" = group_ppo ] && [ "${value_source:-critic}" != critic ] \
    && ! { [ "$ROLLOUT" = tree ] && [ "${value_source:-critic}" = prefix_tree ]; } \
    && ! has_key algorithm.group_params.group_max_size && ! has_key algorithm.group_params.boundary_rule; then
  specific+=(++algorithm.group_params.group_max_size="$value_group_size")
fi
if [ "$MULTI_TURN" = 1 ] && [ "$(override_value actor_rollout_ref.rollout.name)" = vllm ]; then
  # vLLM's CPU attention serves heads of 32 dimensions and up; the tool task's tiny model has 16
  default_work_dir=$default_work_dir-small
  prepare_args+=(--model-size small)
  echo "[launcher] rollout.name=vllm with MULTI_TURN=1: the tool task on the small model (WORK_DIR=${WORK_DIR:-$repo/$default_work_dir})"
fi
WORK_DIR=${WORK_DIR:-$repo/$default_work_dir}
mkdir -p "$WORK_DIR"
WORK_DIR=$(cd "$WORK_DIR" && pwd)
echo "[launcher] task: $WORK_DIR"  # benchmarks/compare.py reads which build of the task a run trained on
N_RANKS=${N_RANKS:-1}
if ! [[ "$N_RANKS" =~ ^[1-9][0-9]*$ ]] || [ $((rank_unit % N_RANKS)) -ne 0 ]; then
  echo "common.sh: N_RANKS='$N_RANKS' must be a positive integer dividing $rank_unit (the $spec_name task's smallest" \
       "mini-batch in responses)" >&2
  exit 2
fi
DEVICE=${DEVICE:-cpu}
case "$DEVICE" in
  cpu)  ray_cpus=8 ;;
  cuda) ray_cpus=$(nproc); threads=$((ray_cpus / (N_RANKS + 2) > 1 ? ray_cpus / (N_RANKS + 2) : 1)) ;;
  *) echo "common.sh: DEVICE='$DEVICE' must be cpu or cuda" >&2; exit 2 ;;
esac

case "${PREPARE:-1}" in
  # every run: prepare does nothing (in seconds) when WORK_DIR already holds the task for these settings
  1) "$PYTHON" -m "$prepare_module" --output-dir "$WORK_DIR" ${prepare_args[@]+"${prepare_args[@]}"} ;;
  0) ;;
  *) echo "common.sh: PREPARE='$PREPARE' must be 0 or 1" >&2; exit 2 ;;
esac
# a model folder given random weights for a timing-only run (python -m verl_group_ppo.tasks.maths.checkpoint
# random-weights) says so at the top of the run's log
if grep -qs '"random-weights"' "$WORK_DIR/model/verl_group_ppo_model.json"; then
  echo "common.sh: $WORK_DIR/model holds RANDOM WEIGHTS: a timing-only run, every score in it is meaningless" >&2
fi

# Multi-turn: verl's ToolAgentLoop for every row (the rows name it too), the calculator as a function tool
# (a file verl executes; it also registers the tinycalc call format), one call per turn.
multi_turn=()
if [ "$MULTI_TURN" = 1 ]; then
  multi_turn=(
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.format=tinycalc
    actor_rollout_ref.rollout.multi_turn.function_tool_path="$tool_file"
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$max_assistant_turns
    actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
  )
fi

# The one switch: verl-group-ppo's plugin installs its CPU backend (platform, FSDP over gloo, ...) in the
# driver and in every Ray worker when VERL_PLATFORM=cpu; on CUDA verl picks its own platform.
if [ "$DEVICE" = cpu ]; then export VERL_PLATFORM=cpu; else unset VERL_PLATFORM; fi
# Threads per process (the spec's on CPU, from nproc with DEVICE=cuda): the tiny task's driver, trainer workers and rollout server share the cores with
# one thread each; the real model computes mostly in one process at a time, which then uses 2.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} MKL_NUM_THREADS=${MKL_NUM_THREADS:-$threads} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0

# Per step: train_batch prompts x rollout_n responses, the actor updated in mini-batches of actor_mini_batch prompts
# and the critic in mini-batches of critic_mini_batch prompts (tiny: 32 x 4 = 128 responses, one actor update and
# two critic updates of 16 prompts; twoway: 16 x 4 = 64 responses, two actor and two critic updates of 8 prompts).
# Micro-batches (responses per rank) must divide every mini-batch: min(32, rank_unit / N_RANKS) does.
# The tiny task's 40 steps: on the model `prepare` builds (the demo's small model), the demo's RL loop with this shape
# raised the reward by +0.07 to +0.20 (first to last 10 of 40 steps; 3 warm-start seeds x 4 RL seeds), and verl by
# +0.052 to +0.114 (three runs of these settings; run-to-run spread from how the rollout's batches form); docs/cpu.md.
# The twoway task's shape was chosen by benchmarks/bench_mathtask_speed.py (docs/mathtask.md, "Speed").
micro_batch=$((rank_unit / N_RANKS < 32 ? rank_unit / N_RANKS : 32))
# verl's replay buffer polled every 0.2 s instead of 2 s (verl_group_ppo/rollout/sampler.py). verl hands a custom
# sampler no DAPO / failed-group refill settings, so it is left out when the run asks for those.
if has_key_prefix algorithm.filter_groups || has_key trainer.v1.sampler.sync_refill_failed_groups ||
   has_key_prefix trainer.v1.sampler.custom_sampler; then
  sampler=()
else
  sampler=(trainer.v1.sampler.custom_sampler.path=pkg://verl_group_ppo.rollout.sampler
           trainer.v1.sampler.custom_sampler.name=replay_buffer)
fi

# Old log-probs = the rollout's log-probs (verl's bypass mode) instead of a second actor forward pass: the hf
# rollout computes them in fp32 with the actor's exact weights, so the recompute returns the same numbers
# (tests/test_cpu_e2e.py checks training/rollout_probs_diff_max at steps 1 and 2). verl's v1 trainer skips
# rollout-correction IS/RS in bypass mode, so a run that sets any algorithm.rollout_correction key gets
# verl's default (recompute) instead.
if has_key_prefix algorithm.rollout_correction; then
  bypass=()
else
  bypass=(algorithm.rollout_correction.bypass_mode=True)
fi

shared=(
  data.train_files="$WORK_DIR/data/train.parquet"
  data.val_files="$WORK_DIR/data/test.parquet"
  data.train_batch_size=$train_batch
  data.val_batch_size=64
  data.max_prompt_length=$prompt_length
  data.max_response_length=$response_length
  data.dataloader_num_workers=0
  algorithm.gamma=1.0
  algorithm.lam=1.0
  algorithm.use_kl_in_reward=False
  reward.custom_reward_function.path=$reward_path
  reward.custom_reward_function.name=compute_score
  reward.num_workers=1
  actor_rollout_ref.model.path="$WORK_DIR/model"
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=False
  actor_rollout_ref.model.enable_gradient_checkpointing=False
  actor_rollout_ref.actor.strategy=fsdp2
  # fp32 like the hf rollout: verl's FSDP engine computes in bf16 unless mixed_precision.param_dtype says
  # otherwise (its fsdp_config.dtype is read by the Megatron engine only)
  ++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32
  actor_rollout_ref.actor.use_torch_compile=False
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False
  actor_rollout_ref.actor.optim.lr=$actor_lr
  actor_rollout_ref.actor.ppo_mini_batch_size=$actor_mini_batch
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$micro_batch
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.rollout.name=hf
  actor_rollout_ref.rollout.n=$rollout_n
  actor_rollout_ref.rollout.temperature="$temperature"
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$micro_batch
  actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.agent.num_workers=2
  critic.model.path="$WORK_DIR/model"
  +critic.model.override_config.attn_implementation=sdpa
  critic.model.use_remove_padding=False
  critic.model.enable_gradient_checkpointing=False
  critic.strategy=fsdp2
  ++critic.fsdp.mixed_precision.param_dtype=fp32
  critic.fsdp.use_torch_compile=False
  critic.optim.lr=$critic_lr
  critic.ppo_mini_batch_size=$critic_mini_batch
  critic.ppo_micro_batch_size_per_gpu=$micro_batch
  trainer.critic_warmup=0
  trainer.device=$DEVICE
  trainer.n_gpus_per_node=$N_RANKS
  trainer.nnodes=1
  trainer.logger=[console]
  trainer.project_name=$project
  trainer.experiment_name="${spec_name}_$estimator"
  trainer.total_epochs=100
  trainer.total_training_steps=$steps
  trainer.val_before_train=$val_before_train
  trainer.test_freq=$test_freq
  trainer.save_freq=1000000
  trainer.resume_mode=disable
  trainer.default_local_dir="$WORK_DIR/checkpoints/$estimator"
  ray_kwargs.ray_init.num_cpus=$ray_cpus
  ++ray_kwargs.ray_init.num_gpus=$N_RANKS
  +ray_kwargs.ray_init.include_dashboard=False
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1
)

cd "$WORK_DIR"
set -x
exec nice -n "${NICE:-5}" "$PYTHON" -m verl.trainer.main_ppo "${shared[@]}" \
  "${sampler[@]}" "${bypass[@]}" "${specific[@]}" ${multi_turn[@]+"${multi_turn[@]}"} ${tree[@]+"${tree[@]}"} "$@"
