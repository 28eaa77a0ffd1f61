"""Whether a checkpoint (or a Hugging Face folder) fits the recipe's model: the shapes of every parameter, checked
from the files' metadata alone. The trainer's load (training/checkpoint.py) refuses a mismatch here, and
train.py --check runs the same check in one process before any rank starts (preflight_checkpoint)."""
from __future__ import annotations

import os
import sys

import torch
from torch.distributed.checkpoint import FileSystemReader

from config import RecipeError
from models.hf import from_hf_config, read_hf_config
from models.llama import Llama
from training import checkpoint_files as files


def expected_model_shapes(model_config) -> dict[str, tuple]:
    """Every parameter of the full model (all pipeline stages) and its global shape, from a meta-device build; a tied
    output weight under its own name too, as the model's state dict (and so a checkpoint) has it."""
    with torch.device("meta"):
        model = Llama(model_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def check_model_shapes(stored: dict, expected: dict[str, tuple], where: str) -> None:
    """`stored`: DCP metadata entries; refuses another model shape, naming the first mismatched parameter."""
    saved = {key[len("model."):]: tuple(md.size) for key, md in stored.items()
             if key.startswith("model.") and hasattr(md, "size")}
    for name, shape in expected.items():
        if name not in saved:
            raise RecipeError(f"checkpoint '{where}' has no parameter {name}: it was saved from another model "
                              f"shape. Use a matching [model] or another checkpoint folder.")
        if saved[name] != shape:
            raise RecipeError(f"checkpoint '{where}' was saved from another model shape: parameter {name} is "
                              f"{list(saved[name])} there and {list(shape)} here. Use a matching [model] or "
                              f"another checkpoint folder.")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise RecipeError(f"checkpoint '{where}' has parameter {extra[0]} that this model lacks ({len(extra)} "
                          f"extra): it was saved from another model shape. Use a matching [model].")


def preflight_checkpoint(cfg, model_config) -> None:
    """Single-process checks before any rank starts (train.py --check): the checkpoint that would be resumed, or the
    HF folder that would be loaded, fits the recipe's model. Checksums are left to the real load."""
    c = cfg.checkpoint
    folder = os.path.join(cfg.job.dump_folder, c.folder)
    if c.enable and c.load_step != 0:
        steps = files.published_steps(folder)
        if c.load_step > 0 and c.load_step not in steps:
            raise RecipeError(f"checkpoint.load_step = {c.load_step}: '{files.step_dir(folder, c.load_step)}' "
                              f"does not exist or was never completed. Complete checkpoints: {steps or 'none'}.")
        for step in [c.load_step] if c.load_step > 0 else reversed(steps):
            directory = files.step_dir(folder, step)
            try:
                stored = FileSystemReader(directory).read_metadata().state_dict_metadata
            except Exception:
                continue  # the real load names the broken file (or falls back to an older checkpoint)
            check_model_shapes(stored, expected_model_shapes(model_config), directory)
            return
    if c.hf_load_path:
        hf = from_hf_config(read_hf_config(c.hf_load_path), where=os.path.join(c.hf_load_path, "config.json"))
        for field in ("dim", "n_layers", "n_heads", "num_kv_heads", "vocab_size", "ffn_hidden_dim", "head_dim",
                      "qkv_bias", "qk_norm"):
            if getattr(hf, field) != getattr(model_config, field):
                raise RecipeError(f"checkpoint.hf_load_path '{c.hf_load_path}' has {field} {getattr(hf, field)} but "
                                  f"the recipe's model has {getattr(model_config, field)}; set [model] to match.")
        for field in ("rope_theta", "rope_scaling_factor", "norm_eps"):
            if getattr(hf, field) != getattr(model_config, field) and "RANK" not in os.environ:  # said once
                print(f"warning: checkpoint.hf_load_path '{c.hf_load_path}' has {field} {getattr(hf, field)}, the "
                      f"recipe's model {getattr(model_config, field)}; training uses the recipe's.", file=sys.stderr)
