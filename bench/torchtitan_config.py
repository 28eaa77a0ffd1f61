"""TorchTitan 0.3.0 side of bench/bench_gpu.py: a TorchTitan trainer config for the Llama shape the bench measures.

TorchTitan reads it by import: `torchrun ... -m torchtitan.train --module bench.torchtitan_config --config
longctx_llama`. The shape, sequence length, batch, steps and local asset folders arrive as JSON in the environment
variable LONGCTX_TORCHTITAN_JOB (TorchTitan's command line cannot change a model's shape). Written against
TorchTitan 0.3.0's sources (torchtitan/models/llama3/__init__.py builds its flavors the same way); other versions
may need changes here.

Kept equal to our trainer's run: the same Llama blocks (SwiGLU hidden size by Meta's rule, GQA, RMSNorm, untied
output), the same vocabulary size, fp32 master weights with bf16 compute (TorchTitan: autocast on one GPU; ours:
FSDP2 mixed precision on one rank), AdamW, no activation checkpointing, no torch.compile of the model, no CUDA
graphs, one full cross entropy (no chunked loss). Attention is TorchTitan's document-masked kernel ("flex", its
default, or "varlen"), the counterpart of our document masking. Text and tokenizer are local files the bench writes.
"""
from __future__ import annotations

import json
import os

JOB_ENV = "LONGCTX_TORCHTITAN_JOB"


def _model_spec(job: dict):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
                                          model_registry)
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads, vocab = job["dim"], job["n_heads"], job["vocab_size"]
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=job["n_layers"], dim=dim, n_heads=heads, n_kv_heads=job["n_kv_heads"],
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=job["multiple_of"],
                                              ffn_dim_multiplier=job["ffn_dim_multiplier"]),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max(job["seq_len"], 8192), theta=job["rope_theta"],
                                    scaling="none"),
            attn_backend=job["attention"]))
    spec = model_registry("debugmodel", attn_backend=job["attention"])
    spec.model, spec.flavor = config, "longctx-bench"
    return spec


def longctx_llama():
    """The Trainer.Config TorchTitan's ConfigManager asks for (`--config longctx_llama`)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    job = json.loads(os.environ[JOB_ENV])
    spec = _model_spec(job)
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        hf_assets_path=job["tokenizer_dir"],
        dump_folder=job["dump_folder"],
        model_spec=spec,
        optimizer=default_adamw(lr=job["lr"]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=job["batch"], seq_len=job["seq_len"], steps=job["steps"],
                                dtype="float32", mixed_precision_param="bfloat16", disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=job["text_dir"]),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
    )
