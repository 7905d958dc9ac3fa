"""Knowledge distillation runs (`posttrain distill`): logit distillation on SFT data and on-policy distillation
through the RL loop; the losses live in `posttrain.algorithms.distill`."""
