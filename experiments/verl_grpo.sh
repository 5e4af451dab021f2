#!/usr/bin/env bash
# verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh) as a verl user writes it, pointed
# at the quickstart's data and SFT checkpoint with the quickstart's batch sizes. This harness does
# not run it as a script: `harness config from-verl experiments/verl_grpo.sh --out F` turns it
# into a TOML experiment, saying what it mapped, what has no effect here (FSDP, vLLM, node
# counts) and what it refused; then `harness train F`.
set -x

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=data/tiny-addition/train.parquet \
    data.val_files=data/tiny-addition/test.parquet \
    data.train_batch_size=64 \
    data.max_prompt_length=64 \
    data.max_response_length=8 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=models/tiny-llama-sft \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=0.5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","tensorboard"]' \
    trainer.project_name='quickstart' \
    trainer.experiment_name='verl-grpo' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=10 \
    trainer.test_freq=10 \
    trainer.log_val_generations=3 \
    trainer.total_training_steps=40 $@
