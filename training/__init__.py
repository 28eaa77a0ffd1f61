"""The training loop (trainer, step, loss, checkpoints, metrics, ramps, export) at this level; planning a run in
training/planning/, evaluating it in training/evaluation/."""
