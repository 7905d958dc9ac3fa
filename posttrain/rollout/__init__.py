"""posttrain.rollout: prompts -> sampled, scored completions as plain data (`Rollouts`, `generate_rollouts`), the
layer that RL (in-process and on the fleet), evaluation, distillation and the demo share."""
