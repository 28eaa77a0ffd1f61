"""The planning probes' fake world: one rank of a run on fake tensors, without a GPU and without the memory.

- world.py: the fake process group, mesh, meta model, composer and fake mode (`fake_world`), restored on exit;
- cuda.py: fake CUDA on a CPU-only build (one source-hashed C++ builder, keyed by torch's library folder);
- counter.py: the one dispatch counter (op kinds and bytes, attention calls, host syncs and where they were made).
"""
