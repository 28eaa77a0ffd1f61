"""Where a one-GPU step's time goes, counted on a CPU: the aten ops (≈ kernel launches) and the bytes they touch in
ONE optimizer step of our trainer and of the plain transformers loop (bench/transformers_peer.py), same Llama shape.

    python bench/bench_step_kernels.py [--seq-len 8192] [--layers 8] [--json PATH] [--markdown]

Why: on an H100 our one-GPU step at 8K tokens is slower than the plain transformers loop (issue 36). Timing needs
the GPU; counting does not. Both steps run on fake tensors (torch's FakeTensorMode: shapes and dtypes, no storage,
no kernels), so the whole step (forward, backward, gradient clipping, optimizer step, zero_grad) runs in seconds on
a CPU, and a TorchDispatchMode sees every aten op it dispatches. Fake tensors take no time: these are counts, not
timings. More ops means more launches and more passes over memory, not a measured slowdown.

What a count means (training/planning/fake/counter.py, the counter the dry run also prices an eager step from): one
aten op reaching the dispatcher is one or more device kernels on a GPU; ops that launch nothing go to the "no
kernel" bucket, so "total kernels" is the rest. "MiB moved" sums the bytes of each op's tensor inputs and outputs.

The device is fake CUDA. A CPU-only torch build runs a fake CUDA forward with a no-op device guard, but its
autograd engine asks for the accelerator's streams. So both steps run in a child process with
training/planning/fake/cuda.py's fake CUDA runtime preloaded (a device guard with no-op streams and events,
CUDA hooks that report a device). Three things a CPU build cannot decide are set as an H100 would:
- autocast on "cuda" is allowed in bf16 (torch asks torch.cuda.is_available() and is_bf16_supported());
- SDPA calls go to the op its dispatcher picks on an H100 with torch 2.11, cuDNN's fused attention
  (`_scaled_dot_product_cudnn_attention`, one op each way per block, K/V heads as given). On fake CUDA the CPU
  build's dispatcher falls back to the math path;
- the transformers side passes clip_grad_norm_(foreach=True), which is what foreach=None picks on a GPU for real
  tensors (the check is `type(grad) is Tensor`, which a fake tensor is not).
`--device cpu` counts on fake CPU tensors instead, in this process, with the CPU's own autocast and SDPA.

Our step is the trainer's own machinery in the memory probe's fake world (training/planning/fake/world.py): the real
model on meta, the real composer (parallelisms.parallelize.parallelize) under a fake process group of world 1, then
training.step.micro_step + clip_grad_norm_ + build_optimizer's AdamW. Both sides make their optimizer state with a
first, uncounted step, as every training step after the first has it. At world 1 in bf16 that is what a one-GPU run
does since issue 36: float32 parameters under torch.autocast (no FSDP2 on a mesh of one) and fused AdamW (the fake
rank stands for a CUDA rank). `--markdown` prints the table of docs/gpu_step.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from training.planning.fake.counter import KINDS, DispatchCounter  # noqa: E402
from training.planning.fake.cuda import fake_cuda_preloaded  # noqa: E402

MIB = 2**20
CHILD_MARK = "BENCH_STEP_KERNELS_RESULT="


def our_config(dim: int, layers: int, n_heads: int, n_kv_heads: int, vocab: int, seq: int,
               overrides: list[str] | None = None):
    from config.recipe import load_config

    return load_config(os.path.join(ROOT, "recipes", "debug.toml"), [
        "--model.dim", str(dim), "--model.n_layers", str(layers), "--model.n_heads", str(n_heads),
        "--model.n_kv_heads", str(n_kv_heads), "--model.vocab_size", str(vocab),
        "--training.seq_len", str(seq), "--training.local_batch_size", "1", "--training.dtype", "bfloat16",
        "--parallelism.dp_shard", "1", "--parallelism.cp", "1", "--activation_checkpoint.mode", "none",
        *(overrides or [])])


def count_ours(cfg, device: str) -> dict:
    """One optimizer step of our trainer at world 1, built and run as the dry run's memory probe does
    (training/planning/fake/world.fake_world: the real composer on a fake process group, optimizer state made by a
    first, uncounted step), on fake `device` tensors."""
    from training import step
    from training.planning.fake.world import fake_batch, fake_world
    from training.step import clip_grad_norm_

    with fake_world(cfg, world_size=1, device=device, optimizer=True) as fake:
        counter = DispatchCounter()
        with counter:
            step.micro_step(fake.setup, fake_batch(cfg, device), fake.global_tokens)
            if cfg.training.max_norm > 0:
                clip_grad_norm_(fake.params, cfg.training.max_norm)
            fake.optimizer.step()
            fake.optimizer.zero_grad(set_to_none=True)
        result = counter.by_kind()
        result["param_devices"] = sorted({str(q.device) for q in fake.params})
        result["param_dtypes"] = sorted({str(q.dtype) for q in fake.params})
        return result


def count_transformers(dim: int, layers: int, n_heads: int, n_kv_heads: int, seq: int, vocab: int,
                       device: str) -> dict:
    """One step of bench/transformers_peer.py's loop on fake `device` tensors: fp32 weights, autocast bf16, loss from labels,
    backward, clip_grad_norm_(1.0), AdamW(fused=True), zero_grad. Optimizer state made by an uncounted first step."""
    from bench.transformers_peer import hf_llama

    with torch.device("meta"):
        model = hf_llama(dim, layers, n_heads, n_kv_heads, seq)
    if model.config.vocab_size != vocab:
        raise ValueError(f"the peer's vocab is {model.config.vocab_size}, ours {vocab}")
    model.train()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=3e-4, fused=True)
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens = torch.zeros((1, seq), dtype=torch.long, device=device)
        counter = DispatchCounter()
        with counter:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            # foreach=True: what None picks on a real GPU (it checks type(grad) is Tensor, and a fake is not)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counter.by_kind()


class SdpaAsOnHopper(TorchFunctionMode):
    """SDPA calls as torch 2.11's dispatcher runs them on an H100: cuDNN's fused attention, one op each way (its
    autograd formula is the backward op). Fake CUDA on a CPU build would take the math path instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v, *rest = args
            mask = kwargs.get("attn_mask", rest[0] if rest else None)
            if mask is None and kwargs.get("dropout_p", 0.0) == 0.0:
                is_causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
                with_lse = q.requires_grad or k.requires_grad or v.requires_grad
                return torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, with_lse, 0.0, is_causal, False, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_h100():
    """Autocast in bf16 on fake CUDA (torch asks the runtime, which a CPU build lacks), SDPA as on an H100, and the
    transformers loop's rows seen as the single sequences they are (see `_as_on_real_tensors`)."""
    from transformers import masking_utils

    saved = (torch.cuda.amp.common.amp_definitely_not_available, torch.cuda.is_bf16_supported,
             masking_utils.find_packed_sequence_indices)
    torch.cuda.amp.common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    masking_utils.find_packed_sequence_indices = _as_on_real_tensors(saved[2])
    try:
        with SdpaAsOnHopper():  # FSDP2's streams on fake CUDA come with the fake world
            yield
    finally:
        (torch.cuda.amp.common.amp_definitely_not_available, torch.cuda.is_bf16_supported,
         masking_utils.find_packed_sequence_indices) = saved


def _as_on_real_tensors(find_packed):
    """transformers looks for packed sequences in the position ids (masking_utils.find_packed_sequence_indices) and,
    finding none in real tensors, lets SDPA run with is_causal=True and no mask. It cannot read a fake tensor, so it
    would build a dense (S, S) causal mask instead, which no GPU run of this loop does: its rows are one sequence
    each (position ids 0..S-1), so the answer on real tensors is None."""
    def find(position_ids):
        from torch._subclasses.fake_tensor import is_fake

        return None if is_fake(position_ids) else find_packed(position_ids)
    return find


def run(seq: int = 8192, layers: int = 8, dim: int = 2048, n_heads: int = 16, n_kv_heads: int = 8,
        vocab: int = 2048, overrides: list[str] | None = None, device: str = "cuda") -> dict:
    """Both sides' counts at this shape; `overrides` are extra recipe overrides for our side only. On "cuda" it
    runs in a child process with the fake CUDA runtime preloaded (unless this one has it)."""
    kwargs = dict(seq=seq, layers=layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab=vocab,
                  overrides=overrides, device=device)
    if device == "cuda" and not fake_cuda_preloaded():
        return _in_child(kwargs)
    from models.llama import recipe_model_config

    cfg = our_config(dim, layers, n_heads, n_kv_heads, vocab, seq, overrides)
    mcfg = recipe_model_config(cfg)
    with fake_h100() if device == "cuda" else contextlib.nullcontext():
        ours = count_ours(cfg, device)
        theirs = count_transformers(dim, layers, n_heads, n_kv_heads, seq, vocab, device)
    shape = {"dim": dim, "layers": layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "vocab": vocab,
             "seq": seq, "ffn_hidden_dim": mcfg.ffn_hidden_dim,
             "loss_chunk_tokens": cfg.training.loss_tile_tokens(vocab), "device": f"fake {device}"}
    return {"shape": shape, "ours": ours, "transformers": theirs}


def _in_child(kwargs: dict) -> dict:
    """`run(**kwargs)` in a child process with the fake CUDA runtime preloaded; its result comes back as JSON."""
    import subprocess

    from training.planning.fake.cuda import fake_cuda_env

    code = ("import json, sys; from bench.bench_step_kernels import run, CHILD_MARK; "
            "print(CHILD_MARK + json.dumps(run(**json.loads(sys.stdin.read()))))")
    from harness.launch_env import child_env

    env = fake_cuda_env(child_env())
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(kwargs), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench_step_kernels on fake CUDA failed: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len(CHILD_MARK):])


def table(result: dict, top: int = 10) -> str:
    ours, theirs = result["ours"], result["transformers"]
    rows = [f"{'kind':<18} | {'ops ours':>9} | {'ops transformers':>16} | {'MiB moved ours':>15} | "
            f"{'MiB moved theirs':>16}"]
    rows.append("-" * len(rows[0]))
    for k in KINDS:
        rows.append(f"{k:<18} | {ours['ops'][k]:>9} | {theirs['ops'][k]:>16} | {ours['bytes'][k] / MIB:>15.0f} | "
                    f"{theirs['bytes'][k] / MIB:>16.0f}")
    for side in (ours, theirs):
        side["kernel_ops"] = side["total_ops"] - side["ops"]["no kernel"]
    rows.append(f"{'total kernels':<18} | {ours['kernel_ops']:>9} | {theirs['kernel_ops']:>16} |")
    rows.append(f"{'total':<18} | {ours['total_ops']:>9} | {theirs['total_ops']:>16} | "
                f"{ours['total_bytes'] / MIB:>15.0f} | {theirs['total_bytes'] / MIB:>16.0f}")
    names = set(ours["per_op"]) | set(theirs["per_op"])
    names = {n for n in names if not n.startswith(("prim.", "profiler."))}
    diff = sorted(names, key=lambda n: -abs(ours["per_op"].get(n, 0) - theirs["per_op"].get(n, 0)))[:top]
    rows.append("")
    rows.append(f"top {top} aten ops by count difference:")
    rows.append(f"{'op':<52} | {'ours':>6} | {'theirs':>6}")
    for n in diff:
        rows.append(f"{n:<52} | {ours['per_op'].get(n, 0):>6} | {theirs['per_op'].get(n, 0):>6}")
    return "\n".join(rows)


def markdown(result: dict) -> str:
    """The docs' table (docs/gpu_step.md): ops and MiB moved per kind, both sides, and the kernel totals."""
    ours, theirs = result["ours"], result["transformers"]
    rows = ["| kind | ops ours | ops transformers | MiB moved ours | MiB moved transformers |", "|---|---|---|---|---|"]
    for k in KINDS:
        rows.append(f"| {k} | {ours['ops'][k]:,} | {theirs['ops'][k]:,} | {ours['bytes'][k] / MIB:,.0f} | "
                    f"{theirs['bytes'][k] / MIB:,.0f} |")
    kernels = [side["total_ops"] - side["ops"]["no kernel"] for side in (ours, theirs)]
    rows.append(f"| **total kernels** | **{kernels[0]:,}** | **{kernels[1]:,}** | | |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the counts here")
    parser.add_argument("--markdown", action="store_true", help="print the docs' table (docs/gpu_step.md) instead")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="fake CUDA (default) or fake CPU")
    a = parser.parse_args()
    result = run(seq=a.seq_len, layers=a.layers, device=a.device)
    if a.markdown:
        print(markdown(result))
    else:
        print(f"shape: {result['shape']}")
        print(f"ours: params on {result['ours']['param_devices']} as {result['ours']['param_dtypes']}")
        print(table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
