"""The run-time checks every launch runs before a rank starts training (train.py, the trainer's stage switches):
the recipe against the world size and the model (preflight.py), the GPUs and the attention kernel they can run
(device_check.py), the evaluations each stage runs (eval_config.py). The planning tools (training/planning/)
call them too, but nothing here measures or prices."""
