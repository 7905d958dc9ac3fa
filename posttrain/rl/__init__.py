"""posttrain.rl: reinforcement learning with verifiable rewards (GRPO family) on one host: rollouts, batches, loss, loop."""
