"""Planning a run before it spends GPU time: the dry run, the ramp planner and what they stand on. Start from
workload.py (the one input: what one rank runs in a step), price.py (its calibrated step time; roofline.py the bound
over the same input) and fake/ (the one fake world the memory and CUDA-path probes run the trainer's own step in).
The checks every launch runs at start-up live in training/launch_checks/."""
