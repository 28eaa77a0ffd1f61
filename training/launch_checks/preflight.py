"""Every check that needs no process group, for every ramp stage: run before torchrun starts (train.py --check)
and again by each rank, so bad input is one line naming the key and the fix, never a hang or a traceback wall."""
from __future__ import annotations

import math

from config import RecipeError, Refusal
from config.recipe import check_cpu_offload, check_offload
from config.schema import Config
from data.sources import check_sources
from models.llama import recipe_model_config
from parallelisms.cp.exchange_alltoall import kv_replication
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline_parallel import plan_pipeline
from parallelisms.cp.layouts import sequence_divisor
from parallelisms.sublayer_groups import refusal as sublayer_groups_refusal
from parallelisms.tensor_parallel import check_tp_degree
from training.launch_checks.eval_config import stage_eval_config
from training.evaluation.niah import niah_eval_lengths
from training.ramp import RampStage, resolve_stages


def preflight_stages(cfg: Config, world_size: int, check_data: bool = True) -> list[RampStage]:
    """The recipe's stages (one without [[ramp]]), each checked; errors name the stage. The data (the same sources in
    every stage; a stage's own weights are checked as it is resolved) is checked once; `check_data=False` leaves it
    out (the dry run plans a recipe whose data lives on the cluster)."""
    if check_data:
        check_sources(cfg)  # names, weights and paths of the sources and the tokenizer; reads no file
    check_passkey_stop(cfg)  # the recipe's own keys: a stage's evaluation config clears them before its last stage
    stages = resolve_stages(cfg, world_size)
    for stage in stages:
        try:
            preflight(stage_eval_config(stage, last=stage is stages[-1]), world_size)  # the evaluations it runs
        except RecipeError as e:
            if stage.index < 0:
                raise
            raise RecipeError(f"{stage.name} (start_step {stage.start_step}, seq_len "
                              f"{stage.cfg.training.seq_len}, cp {stage.cfg.parallelism.cp}): {e}") from None
    return stages


def required_ranks(cfg: Config) -> int:
    """The ranks a recipe asks for when NPROC is not given (dp_shard = -1 counts as 1)."""
    p = cfg.parallelism
    return p.pp * p.dp_replicate * max(1, p.dp_shard) * p.cp * p.tp


def preflight(cfg: Config, world_size: int):
    """Every check of one stage that needs no process group (data aside: preflight_stages checks it once); returns
    the resolved parallel degrees."""
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    mcfg = recipe_model_config(cfg)
    rows_per_step = cfg.training.local_batch_size * dims.dp
    gbs = cfg.training.global_batch_size
    if gbs != -1 and (gbs <= 0 or gbs % rows_per_step):
        raise RecipeError(f"{cfg.recipe_path}: training.global_batch_size {gbs} must be a multiple of "
                          f"local_batch_size x dp = {rows_per_step}. Use {max(1, gbs // rows_per_step) * rows_per_step}.")
    if p.tp > 1:
        check_tp_degree(mcfg.n_heads, mcfg.num_kv_heads, p.tp, where=cfg.recipe_path)
    if p.attention_sublayer_groups > 1:
        refused = sublayer_groups_refusal(cfg, mcfg.n_heads, mcfg.num_kv_heads, mcfg.qkv_bias or mcfg.qk_norm)
        if refused:
            raise RecipeError(f"{cfg.recipe_path}: parallelism.attention_sublayer_groups = "
                              f"{p.attention_sublayer_groups}: {refused}")
    check_sequence_split(cfg)
    check_offload(cfg)  # a dry run's candidate or a ramp stage is a Config that load_config did not validate
    check_cpu_offload(cfg)
    if p.cp_impl == "ulysses" and p.cp > 1:  # hybrid and auto fall back to what the heads allow
        try:
            kv_replication(mcfg.n_heads // p.tp, mcfg.num_kv_heads // p.tp, p.cp)
        except Refusal as e:
            raise RecipeError(f"{cfg.recipe_path}: parallelism.cp_impl = \"ulysses\" with cp {p.cp}: {e}") from None
    if p.pp > 1:
        if mcfg.tie_embeddings:
            raise RecipeError(f"{cfg.recipe_path}: a tied model ([model] tie_embeddings, e.g. Llama 3.2 1B/3B) cannot "
                              f"be split into pipeline stages here (the first and last stage would share the "
                              f"embedding); use pp = 1 with FSDP / TP / CP, or set --model.tie_embeddings untied.")
        if cfg.data.document_masking:
            raise RecipeError(f"{cfg.recipe_path}: data.document_masking is not supported with parallelism.pp > 1 "
                              f"(document ids are per batch, the pipeline splits batches). Set pp = 1.")
        plan_pipeline(mcfg.n_layers, p.pp, p.pp_schedule, p.pp_layers_per_stage, p.pp_microbatches,
                      cfg.training.local_batch_size, where=cfg.recipe_path)
    if cfg.eval.passkey:
        if p.pp > 1:
            raise RecipeError(f"{cfg.recipe_path}: eval.passkey runs the whole model on each rank and is not "
                              f"supported with parallelism.pp > 1. Evaluate a checkpoint with pp = 1.")
        for length in cfg.eval.passkey_lengths:
            check_sequence_split(cfg, length, "eval.passkey_lengths")
    e = cfg.eval
    if e.niah:
        if p.pp > 1:
            raise RecipeError(f"{cfg.recipe_path}: eval.niah runs the whole model on each rank and is not supported "
                              f"with parallelism.pp > 1. Evaluate a checkpoint with pp = 1.")
        if e.niah_depths < 1 or e.niah_samples < 1 or e.niah_interval < 0:
            raise RecipeError(f"{cfg.recipe_path}: eval.niah_depths and niah_samples must be >= 1 and niah_interval "
                              f">= 0 (got {e.niah_depths}, {e.niah_samples}, {e.niah_interval}).")
        for length in niah_eval_lengths(cfg):  # the lengths this stage evaluates
            check_sequence_split(cfg, length, "eval.niah_lengths")
    if e.long_doc_loss:
        if p.pp > 1:
            raise RecipeError(f"{cfg.recipe_path}: eval.long_doc_loss runs the whole model on each rank and is not "
                              f"supported with parallelism.pp > 1. Set pp = 1 or long_doc_loss = false.")
        if cfg.data.dataset != "text":
            raise RecipeError(f"{cfg.recipe_path}: eval.long_doc_loss needs real documents (data.dataset = "
                              f"\"text\"), not {cfg.data.dataset!r} rows.")
        if not 0 < e.long_doc_heldout < 1 or e.long_doc_rows < 1 or e.long_doc_interval < 0:
            raise RecipeError(f"{cfg.recipe_path}: eval.long_doc_heldout must be in (0, 1), long_doc_rows >= 1 and "
                              f"long_doc_interval >= 0 (got {e.long_doc_heldout}, {e.long_doc_rows}, "
                              f"{e.long_doc_interval}).")
    return dims


def check_sequence_split(cfg: Config, seq_len: int | None = None, key: str = "training.seq_len") -> None:
    """seq_len must split into CP shards (2*cp chunks for zigzag; the ring also runs at cp=1 for document masking)
    and each CP shard into tp pieces for sequence parallelism."""
    p = cfg.parallelism
    seq_len = cfg.training.seq_len if seq_len is None else seq_len
    cp_active = p.cp > 1 or cfg.data.document_masking
    cp_multiple = sequence_divisor(p.cp, p.cp_load_balancer) if cp_active else 1
    multiple = math.lcm(cp_multiple, p.cp * p.tp)
    if seq_len % multiple == 0:
        return
    nearest = max(multiple, round(seq_len / multiple) * multiple)
    parts = []
    if cp_multiple > 1:
        parts.append(f"{cp_multiple} for {p.cp_load_balancer} CP over {p.cp} rank(s)")
    if p.tp > 1:
        parts.append(f"cp x tp = {p.cp * p.tp} for sequence parallelism over tp {p.tp}")
    raise RecipeError(f"{cfg.recipe_path}: {key} {seq_len} is not divisible by {multiple} "
                      f"({'; '.join(parts)}). Use {nearest}.")


def check_passkey_stop(cfg: Config) -> None:
    """eval.passkey_interval, passkey_stop_at and passkey_stop_mean: in range, and a stop only with the evaluations
    that decide it."""
    e = cfg.eval
    if e.passkey_interval < 0 or not 0 <= e.passkey_stop_at <= 1 or not 0 <= e.passkey_stop_mean <= 1:
        raise RecipeError(f"{cfg.recipe_path}: eval.passkey_interval must be >= 0 and passkey_stop_at, "
                          f"passkey_stop_mean in [0, 1] (got {e.passkey_interval}, {e.passkey_stop_at}, "
                          f"{e.passkey_stop_mean}).")
    if (e.passkey_stop_at or e.passkey_stop_mean) and not (e.passkey and e.passkey_interval):
        raise RecipeError(f"{cfg.recipe_path}: eval.passkey_stop_at and passkey_stop_mean end the run at a passkey "
                          f"evaluation during training; set eval.passkey = true and eval.passkey_interval > 0, or "
                          f"both to 0.")
