"""The peer that bench/bench_gpu.py measures our trainer against on any torch: Hugging Face transformers'
`LlamaForCausalLM` of the same shape, trained by the simplest loop a user would write.

    python bench/transformers_peer.py [--dim 2048] [--n-layers 8] [--n-heads 16] [--n-kv-heads 8] [--seq 8192]
                                      [--batch 1] [--steps 6] [--warmup 2]

prints one JSON line: tokens/s (median over the steps after --warmup), peak memory (GiB, the allocator's
max_memory_allocated on CUDA, as our trainer logs it), the last loss.

Why this peer: TorchTitan is written against one torch each release (0.3.0 does not import on torch 2.11), so a
comparison that needs it is missing on exactly the GPU images that lag behind; transformers imports on every torch
this repository supports. The loop is deliberately plain: the model in fp32 (the master weights) moved to the GPU,
`torch.autocast` to bf16, `torch.optim.AdamW(fused=True)`, SDPA attention (causal, no mask tensor: the flash
kernel), random token batches of the bench shape, gradients clipped at 1.0 as the debug recipe clips ours. No
torch.compile, no activation checkpointing, no fused loss: what a user gets without tuning. The shape is our
LlamaConfig written as Hugging Face's config (models/hf_config.py, the exporter's), so the two models have the same
parameters. The fast tier runs this loop on the CPU with a tiny shape (tests/test_transformers_peer.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/transformers_peer.py` puts bench/ first on the path, not the root
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

GIB = 2**30


def hf_llama(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, seq: int):
    """transformers' LlamaForCausalLM (fp32, SDPA attention) of our debug model's family at this shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf_config import to_hf_config
    from models.llama import model_config

    ours = model_config("debug", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads)
    fields = dict(to_hf_config(ours, torch.float32, max_position_embeddings=seq), use_cache=False)
    return LlamaForCausalLM(LlamaConfig(**fields, attn_implementation="sdpa"))


def train_loop(model, seq: int, batch: int, steps: int, warmup: int, device: torch.device,
               lr: float = 3e-4) -> dict:
    """`steps` optimizer steps on random tokens; {"tokens_per_sec", "peak_gib", "loss", "attention"}."""
    torch.manual_seed(0)
    model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    vocab = model.config.vocab_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, loss = [], float("nan")
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq), device=device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the step, on a GPU too
        seconds.append(time.perf_counter() - start)
    kept = seconds[warmup:] or seconds
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    return {"tokens_per_sec": batch * seq / statistics.median(kept), "peak_gib": peak, "loss": loss,
            "attention": model.config._attn_implementation}


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The model and sequence flags, shared with bench/bench_gpu.py, which passes its own on to this script: both
    sides of the comparison are built from one definition of the shape."""
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    model = hf_llama(args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.seq)
    result = train_loop(model, args.seq, args.batch, args.steps, args.warmup, device, args.lr)
    if not math.isfinite(result["loss"]):
        print(f"transformers peer: the loss is {result['loss']} after {args.steps} steps", file=sys.stderr)
        return 1
    print(json.dumps({**result, "transformers": transformers.__version__, "device": device.type}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
