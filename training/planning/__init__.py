"""Planning a run before it spends GPU time: the dry run and its memory / CUDA-path probes (built in one fake world,
fake/), the roofline and calibrated step model, the accelerators' figures, the ramp planner and its RoPE rule, and the
preflight checks every rank repeats."""
