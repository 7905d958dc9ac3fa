"""posttrain.demo: the embedded default run (`posttrain demo`): SFT then RL on a synthetic task, on CPU."""
