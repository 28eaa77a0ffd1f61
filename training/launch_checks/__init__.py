"""The run-time checks every launch runs before a rank starts training (train.py, the trainer's stage switches):
the recipe against the world size and the model (preflight.py), the GPUs and the attention kernel they can run
(device_check.py), the evaluations each stage runs (eval_config.py), the node's host memory (host_memory.py: `--check`
refuses a stage the node cannot hold; the dry run prints the same plan). The planning tools (training/planning/)
call them too; nothing here runs a probe or prices a step."""
