"""A bf16 run on one device (issue 36): no FSDP2 on a mesh of one; float32 parameters, gradients and AdamW, and the
forward under torch.autocast, so every GEMM of the step runs in bf16 and the residual stream stays bf16 while the
weights stay float32. Multi-rank bf16 keeps FSDP2's mixed precision; tests/parallelisms/test_parity.py holds the
1-rank losses to the same bf16 reference as those meshes."""
import os
import sys
import tempfile

from tests.training.test_shared_step import ROOT, TINY, _in_fresh_process


def _one_rank_bf16_step():
    sys.path.insert(0, ROOT)
    from tests.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from config.recipe import load_config
    from parallelisms.parallelize import uses_autocast, uses_fsdp
    from training.trainer import Trainer

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._opname in ("mm", "addmm", "bmm"):
                self.dtypes.update(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    with tempfile.TemporaryDirectory() as out:
        overrides = TINY + ["--parallelism.dp_shard", "1", "--training.dtype", "bfloat16", "--job.dump_folder", out]
        trainer = Trainer(load_config(os.path.join(ROOT, "recipes", "debug.toml"), overrides))
        try:
            model = trainer.model_parts[0]
            grads = {}
            hooks = [p.register_post_accumulate_grad_hook(lambda p: grads.setdefault(id(p), str(p.grad.dtype)) and None)
                     for p in model.parameters()]
            blocks = set()  # the residual stream: what each block returns
            hooks += [block.register_forward_hook(lambda m, args, out: blocks.add(str(out.dtype)))
                      for block in model.layers.values()]
            with GemmDtypes() as gemms:
                trainer.train_step(trainer._step_batches(iter(trainer.dataloader)))
            for hook in hooks:
                hook.remove()
            return {"autocast": uses_autocast(trainer.cfg, trainer.mesh),
                    "fsdp": uses_fsdp(trainer.cfg, trainer.mesh),
                    "dtensor": any(isinstance(p, DTensor) for p in model.parameters()),
                    "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                    "grad_dtypes": sorted(set(grads.values())), "grads": len(grads),
                    "params": len(list(model.parameters())), "gemm_dtypes": sorted(gemms.dtypes),
                    "block_outputs": sorted(blocks),
                    "optimizer_state": sorted({str(v.dtype) for s in trainer.optimizer.state.values()
                                               for k, v in s.items() if k != "step"})}
        finally:
            trainer.close()


def test_one_device_bf16_is_float32_weights_under_autocast_without_fsdp():
    got = _in_fresh_process(_one_rank_bf16_step)
    assert got["autocast"] and not got["fsdp"] and not got["dtensor"], got
    assert got["param_dtypes"] == ["torch.float32"] and got["optimizer_state"] == ["torch.float32"], got
    assert got["grad_dtypes"] == ["torch.float32"] and got["grads"] == got["params"], got
    assert got["gemm_dtypes"] == ["torch.bfloat16"], got
    assert got["block_outputs"] == ["torch.bfloat16"], got  # activations bf16, as under FSDP2's bf16 weights
