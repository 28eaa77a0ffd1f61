"""Hugging Face Llama / Qwen2.5 / Qwen3 interchange: a folder of config.json + safetensors <-> our `Llama`.

Two layout differences matter, and both are fixed tables here:
- names: `model.layers.i.self_attn.q_proj.weight` <-> `layers.i.attention.wq.weight`, and so on;
- RoPE pairing: HF rotates halves (feature j of a head pairs with feature j + head_dim/2), we pair interleaved features
  (2j, 2j+1) as Meta's reference does. The rows of wq and wk (and their Qwen2.5 biases, and Qwen3's per-head q/k
  norm weights) are permuted within each head on the way in and out, so the same weights give the same attention
  scores; no other weight is touched.
A tied model (one embedding parameter) reads `embed_tokens` and writes it once, with tie_word_embeddings true.

Reading and writing go through torch.distributed.checkpoint's HuggingFace storage reader and writer, so on a sharded
(FSDP / TP / PP) model every rank reads only the slices it holds and an export is written once, consolidated, without
gathering the model on one rank. Only the permuted q/k tensors travel whole, one tensor at a time, because their
permutation crosses shard boundaries.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor, distribute_tensor

from models.llama import Llama, LlamaConfig, canonical_name
from models.hf_config import from_hf_config, read_hf_config, to_hf_config  # noqa: F401 (re-exported)
from config import RecipeError

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
MAX_FILE_BYTES = 5 * 2**30  # export file size, as transformers' default max_shard_size


def hf_name(name: str) -> str:
    """Our (canonical) parameter name -> the HF tensor name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def rotate_half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF q/k rows -> ours: within each head, row j (j < hd/2) becomes 2j and row hd/2 + j becomes 2j + 1.
    Works on weights (rows x dim) and on vectors (q/k biases, per-head q/k norm weights: n_heads = 1)."""
    cols = w.shape[-1] if w.dim() == 2 else 1
    return w.reshape(n_heads, 2, -1, cols).transpose(1, 2).reshape(w.shape)


def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Ours -> HF q/k rows (the inverse of `rotate_half_to_interleaved`)."""
    cols = w.shape[-1] if w.dim() == 2 else 1
    return w.reshape(n_heads, -1, 2, cols).transpose(1, 2).reshape(w.shape)


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns that it assumes one process when no process group exists; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------- weights
def _named_parameters(parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    return {canonical_name(fqn): p for part in parts for fqn, p in part.named_parameters()}


def _qk_heads(name: str, cfg: LlamaConfig) -> int | None:
    """Heads to permute over for wq / wk (weights and biases) and the per-head q/k norms (1: the weight is one
    head's), None for every other tensor."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.num_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _place_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` (the whole tensor, on every rank) cut to `param`'s shard when param is a DTensor."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


@torch.no_grad()
def load_hf_weights(model_parts: Sequence[nn.Module], path: str, process_group=None) -> None:
    """Copy an HF folder's weights into the (possibly sharded) model parts held by this rank; all ranks call it."""
    params = _named_parameters(model_parts)
    cfg: LlamaConfig = model_parts[0].config
    hf_cfg = read_hf_config(path)
    reader = HuggingFaceStorageReader(path)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as e:  # a truncated or foreign .safetensors file
        raise RecipeError(f"'{path}': cannot read the safetensors headers ({type(e).__name__}: {e}).") from None
    if not stored:
        raise RecipeError(f"'{path}' holds no *.safetensors files.")
    tied = "lm_head.weight" not in stored and hf_cfg.get("tie_word_embeddings", False)
    if cfg.tie_embeddings and "lm_head.weight" in stored and not hf_cfg.get("tie_word_embeddings", False):
        raise RecipeError(f"'{path}' holds a separate lm_head.weight but [model] tie_embeddings is true; set "
                          f"--model.tie_embeddings false to train it untied.")
    targets: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, param in params.items():
        key = "model.embed_tokens.weight" if tied and name == "output.weight" else hf_name(name)
        if key not in stored:
            raise RecipeError(f"'{path}' has no tensor '{key}' (for parameter {name}); the folder does not hold "
                              f"this model's weights.")
        if tuple(stored[key].size) != tuple(param.shape):
            raise RecipeError(f"'{path}': tensor '{key}' has shape {list(stored[key].size)} but parameter {name} "
                              f"has {list(param.shape)}; the model shapes differ.")
        targets.setdefault(key, []).append((name, param))
    # One target loads straight into its shard; permuted or shared tensors are read whole, then placed.
    request, whole = {}, {}
    for key, users in targets.items():
        name, param = users[0]
        if len(users) == 1 and _qk_heads(name, cfg) is None:
            request[key] = param
        else:
            whole[key] = request[key] = torch.empty(tuple(param.shape), dtype=stored[key].properties.dtype)
    distributed = _group_size(process_group) > 1
    with quiet_single_process_dcp():
        dcp.load(request, storage_reader=reader, process_group=process_group, no_dist=not distributed)
    for key, full in whole.items():
        for name, param in targets[key]:
            heads = _qk_heads(name, cfg)
            placed = _place_like(rotate_half_to_interleaved(full, heads) if heads else full, param)
            if isinstance(param, DTensor):  # shard into shard, across devices for a host-offloaded one (cpu_offload)
                param.to_local().copy_(placed.to_local())
            else:
                param.copy_(placed)


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Llama:
    """A whole Llama from an HF folder (config.json + single or sharded safetensors), in this process."""
    cfg = from_hf_config(read_hf_config(path), where=os.path.join(path, "config.json"))
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    model.set_rope_from(cfg)
    load_hf_weights([model], path)
    return model


def _file_index(sizes: dict[str, int]) -> dict[str, int]:
    """HF tensor name -> 1-based file number, in name order, files up to MAX_FILE_BYTES."""
    mapping, index, used = {}, 1, 0
    for key in sorted(sizes):
        if used and used + sizes[key] > MAX_FILE_BYTES:
            index, used = index + 1, 0
        mapping[key] = index
        used += sizes[key]
    return mapping


def _on_mesh_device(tensor: DTensor) -> DTensor:
    """A DTensor on its mesh's device: a host-offloaded shard (training.cpu_offload) of a CUDA mesh cannot be
    all-gathered by NCCL where it lies."""
    return tensor if tensor.device.type == tensor.device_mesh.device_type else tensor.to(tensor.device_mesh.device_type)


@torch.no_grad()
def save_hf(model: nn.Module | Sequence[nn.Module], path: str, dtype: torch.dtype | None = None,
            process_group=None, plain=None, **config_fields) -> None:
    """Write `path`/config.json + model-*.safetensors (+ index) that `AutoModelForCausalLM.from_pretrained` loads
    (a tied model writes the embedding only, with tie_word_embeddings true).

    `model` may be one Llama or this rank's pipeline parts; on a sharded model every rank of `process_group`
    (default: the world) calls it and the files are written once. dtype None keeps the parameters' dtype.
    `config_fields`: `to_hf_config`'s keywords (bos/eos ids, max_position_embeddings). `plain`: maps {name:
    parameter} to the tensors to write, for parameters held in a tensor subclass that safetensors cannot write
    (training passes parallelisms/float8.py's `plain_weights`, which takes torchao's float8 weight wrapper off).
    """
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    cfg: LlamaConfig = parts[0].config
    state, sizes = {}, {}
    named = _named_parameters(parts)
    for name, param in (plain(named) if plain is not None else named).items():
        out_dtype = dtype or param.dtype
        tensor = param.detach()
        heads = _qk_heads(name, cfg)
        if heads:
            full = _on_mesh_device(tensor).full_tensor() if isinstance(tensor, DTensor) else tensor
            tensor = _place_like(interleaved_to_rotate_half(full, heads), param)
        state[hf_name(name)] = tensor.to(out_dtype)
        sizes[hf_name(name)] = param.numel() * torch.finfo(out_dtype).bits // 8
    if _group_size(process_group) > 1:  # PP ranks hold different names: agree on one file layout
        gathered = [None] * _group_size(process_group)
        dist.all_gather_object(gathered, sizes, group=process_group)
        sizes = {k: v for part in gathered for k, v in part.items()}
    distributed = _group_size(process_group) > 1
    is_writer = not distributed or dist.get_rank(process_group) == 0
    if is_writer:
        os.makedirs(path, exist_ok=True)
    writer = HuggingFaceStorageWriter(path, fqn_to_index_mapping=_file_index(sizes), save_distributed=distributed,
                                      enable_consolidation=distributed)
    with quiet_single_process_dcp():
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    if is_writer:
        shutil.rmtree(os.path.join(path, "sharded"), ignore_errors=True)  # per-rank pieces, now consolidated
        param_dtype = dtype or next(iter(state.values())).dtype
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(to_hf_config(cfg, param_dtype, **config_fields), f, indent=2)
    if distributed:
        dist.barrier(group=process_group)
