"""posttrain.rollout: the `Policy` (a checkpoint opened once: encode, sample, score, swap weights), the prompt
encoder, prompts -> sampled, scored completions as plain data (`Rollouts`, `generate_rollouts`), and generation as
a run: the layer that RL (in-process and on the fleet), evaluation, distillation, generation, chat and the demos
share."""
