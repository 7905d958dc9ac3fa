"""posttrain.eval: the one evaluator (greedy pass@1, sampled pass@k and maj@k with a correctness reward), shared by
RL's held-out evaluation, `posttrain eval` and the demo, and evaluation as a run (`run_eval`)."""
