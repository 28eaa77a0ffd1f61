"""The recipe schema: one dataclass per TOML section, a docstring per field, and the allowed values.

A field with a fixed set of values is typed with a `Literal` alias below (RoPE's in config/rope.py); `CHOICES` (what
the recipe loader checks) and the lists the parallelisms check against (`choices(LoadBalancer)`, ...) are derived
from those aliases, so every allowed value is written once. Loading a recipe, command-line overrides and their
one-line errors live in config/recipe.py.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from config.rope import RopeScaling, RopeSettings
from config.schema_hardware import (ACCELERATOR_MEMORY_GIB, AcceleratorName, DeviceKind,  # noqa: F401
                                    HardwareConfig)
from config.schema_data import (ChatTruncation, DataConfig, Dataset, EvalConfig, Placement, SourceConfig,  # noqa: F401
                                SourceFormat)
from config.schema_run import AsyncMode, CheckpointConfig, ExportDtype, JobConfig, MetricsConfig, StopSignal  # noqa: F401

Dtype = Literal["float32", "bfloat16"]
OptimizerName = Literal["AdamW"]
DecayType = Literal["linear", "cosine", "constant"]
LoadBalancer = Literal["zigzag", "striped", "contiguous", "documents"]
CpImpl = Literal["ring", "allgather", "ulysses", "hybrid", "auto"]
AttentionKernel = Literal["auto", "cudnn", "flash", "fa3", "fa4"]
ReshardPolicy = Literal["default", "always", "never"]
SingleStageSchedule = Literal["GPipe", "1F1B"]
MultiStageSchedule = Literal["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]
PipelineSchedule = Literal[SingleStageSchedule, MultiStageSchedule]
ActivationCheckpointMode = Literal["none", "full", "selective", "op"]
TieMode = Literal["auto", "tied", "untied"]
CompileSetting = Literal["auto", True, False]
Float8Recipe = Literal["off", "tensorwise", "rowwise"]
Float8Emulate = Literal["auto", True, False]


LOSS_TILE_LOGITS = 2**28
"""Logits per loss tile with `training.loss_chunk_tokens = -1`: 1 GiB in float32, what a 2048-token tile of Llama 3's
128,256-token vocabulary holds."""
LOSS_TILE_QUANTUM = 2048
"""Automatic loss tiles are whole multiples of this many tokens."""

MIN_SEQ_LEN = 2
"""The shortest sequence: one input and one label token."""


def choices(alias) -> tuple[str, ...]:
    """The allowed values of a Literal alias, in the order written (nested Literals are flattened by typing)."""
    return typing.get_args(alias)


ZIGZAG, STRIPED, CONTIGUOUS, DOCUMENTS = choices(LoadBalancer)
RING, ALLGATHER, ULYSSES, HYBRID, AUTO = choices(CpImpl)
"""The CP layout and implementation names as constants, unpacked from the aliases above (their one spelling);
parallelisms/cp/layouts.py re-exports them for the CP package."""


@dataclass
class RampTable:
    """One `[[ramp]]` table (training/ramp.py resolves it into a full Config for its span of steps)."""
    start_step: int = -1
    """First optimizer step (0-based, i.e. the number of steps completed) trained with this stage's settings."""
    seq_len: int = 0
    """Sequence length of this stage."""
    cp: int = 0
    """Context-parallel degree of this stage, traded against dp_shard (0 = the recipe's parallelism.cp)."""
    rope_theta: float = 0.0
    """RoPE base from this stage on (0 = keep the previous stage's)."""
    rope_scaling_factor: float = 0.0
    """RoPE scaling factor from this stage on (0 = keep, -1 = off)."""
    rope_type: str = ""
    """RoPE scaling type from this stage on: llama3 | yarn (empty = keep); e.g. rope_type = "yarn" with
    rope_scaling_factor = 4 switches YaRN on at this stage."""
    local_batch_size: int = 0
    """Rows per data-parallel rank per micro-step (0 = derived from tokens_per_step and the recipe's value)."""
    source_weights: dict[str, float] = field(default_factory=dict)
    """Source weights from this stage on, by source name (unnamed sources keep the recipe's weight)."""
    offload: bool | None = None
    """Activation offload from this stage on (None/absent = keep the previous stage's); needs a checkpoint mode."""


@dataclass
class ModelConfig:
    name: str = "debug"
    """Named shape: debug | llama3_8b | llama3_70b | llama3_405b | llama3_2_1b | llama3_2_3b | qwen2_5_7b | qwen3_8b,
    or "hf": every shape and numeric field from checkpoint.hf_load_path's config.json (Llama 3.x, Qwen2.5, Qwen3).
    Fields below override it when set."""
    dim: int = 0
    """Hidden size (0 = from the named config)."""
    n_layers: int = 0
    """Number of transformer blocks (0 = from the named config)."""
    n_heads: int = 0
    """Query heads (0 = from the named config)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention (0 = from the named config)."""
    vocab_size: int = 0
    """Vocabulary size; a trained tokenizer gets exactly this many pieces (0 = from the named config)."""
    rope_theta: float = 0.0
    """RoPE base frequency (0 = from the named config)."""
    rope_scaling_factor: float = 0.0
    """RoPE frequency scaling factor (0 = from the named config; -1 = switch scaling off)."""
    rope_type: RopeScaling = "auto"
    """The scaling rope_scaling_factor applies: llama3 | yarn (auto = the named config's)."""
    rope_original_max_position: int = 0
    """The context the scaling extends (HF original_max_position_embeddings; 0 = from the named config)."""
    intermediate_size: int = 0
    """SwiGLU hidden size (HF intermediate_size; 0 = from the named config)."""
    attention_head_dim: int = 0
    """Per-head width (HF head_dim; 0 = from the named config, where it is dim / n_heads unless given)."""
    tie_embeddings: TieMode = "auto"
    """tied: the output layer is the embedding matrix (one parameter) | untied | auto: the named config's."""
    mlp_chunk_tokens: int = 0
    """The SwiGLU feed-forward computed over tiles of this many tokens, each recomputed in backward
    (models/tiled_mlp.py): its (tokens x ffn_dim) intermediates exist one tile at a time. 0 = untiled."""
    norm_chunk_tokens: int = 0
    """The blocks' RMSNorms computed over tiles of this many tokens (models/tiled_norm.py), keeping only their input
    and a float32 scale per token for the backward (their float32 temporaries: one tile at a time). 0 = untiled.
    With mlp_chunk_tokens too and no TP, the feed-forward's norm runs inside the SwiGLU's tiles (models/tiled_mlp.py)."""

    def overrides(self) -> dict:
        """The fields set in the recipe, as keyword overrides of the named Llama config (models/llama.py)."""
        names = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "mlp_chunk_tokens",
                 "norm_chunk_tokens", "intermediate_size", "attention_head_dim")
        out = {k: getattr(self, k) for k in names if getattr(self, k)}
        if self.tie_embeddings != "auto":
            out["tie_embeddings"] = self.tie_embeddings == "tied"
        return {**out, **RopeSettings.from_recipe(self).model_overrides()}


@dataclass
class TrainingConfig:
    steps: int = 20
    """Optimizer steps to run."""
    seq_len: int = 4096
    """Tokens per sequence (the model sees seq_len inputs and seq_len shifted labels)."""
    local_batch_size: int = 2
    """Sequences per data-parallel rank per micro-step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; a multiple of local_batch_size x dp gives gradient
    accumulation. -1 = local_batch_size x dp (no accumulation)."""
    dtype: Dtype = "float32"
    """Parameter/compute dtype: float32 or bfloat16 (bf16: FSDP2 mixed precision, fp32 master weights and gradient
    reduction; on one device fp32 parameters with the forward under torch.autocast in bf16)."""
    max_norm: float = 1.0
    """Gradient clipping by the global norm over all shards; <= 0 switches clipping off."""
    compile: CompileSetting = "auto"
    """torch.compile each whole transformer block, one graph for its norms, residual adds, attention (under CP one
    registered op) and feed-forward, inside its activation-checkpoint wrapper (the checkpoint itself stays eager);
    with parallelism.tp > 1 the attention and feed-forward are compiled separately instead, because a whole block
    traced with TP's input hooks gets wrong norm-weight gradients (parallelisms/parallelize.py apply_compile). The
    embedding, final norm, output projection and loss stay eager. true, false, or "auto" (on for CUDA, off on CPU,
    where inductor's C++ build costs more than it saves on the test models)."""
    tokens_per_step: int = 0
    """Global tokens per optimizer step kept constant across [[ramp]] stages (the global batch becomes
    tokens_per_step / seq_len rows); 0 = use local/global_batch_size as given."""
    loss_chunk_tokens: int = -1
    """The output projection and the loss computed this many tokens at a time, gradients included
    (models/chunked_loss.py), so the (tokens x vocab) logits never exist whole; 0 = project all tokens at once;
    -1 (default) = `loss_tile_tokens`: 2048-token tiles, widened where the vocabulary is small."""

    def loss_tile_tokens(self, vocab_size: int) -> int:
        """`loss_chunk_tokens` resolved for a model with `vocab_size`: an explicit value as given; -1: as many tokens
        as `LOSS_TILE_LOGITS` float32 logits hold, in whole multiples of 2048 and at least 2048. Llama 3's and Qwen's
        vocabularies (128K-152K) get 2048-token tiles; a 2K vocabulary gets 128K-token tiles, so an 8K or 64K
        micro-batch projects in one tile: each tile is a dozen small kernels and a weight cast each way, and tiling
        logits of a few hundred MiB saves nothing worth them (issue 36)."""
        if self.loss_chunk_tokens >= 0:
            return self.loss_chunk_tokens
        return max(LOSS_TILE_QUANTUM, LOSS_TILE_LOGITS // max(vocab_size, 1) // LOSS_TILE_QUANTUM * LOSS_TILE_QUANTUM)

    float8: Float8Recipe = "off"
    """Float8 training of the transformer blocks' linear layers through torchao (parallelisms/float8.py,
    docs/float8.md): off | tensorwise (one dynamic scale per tensor; under FSDP the weights are all-gathered in
    float8) | rowwise (a scale per row, rounded down to a power of two: more accurate, slower). The embedding and
    the output projection stay in `dtype`. Needs torchao (requirements.txt), imported only when this is not off."""
    float8_emulate: Float8Emulate = "auto"
    """How the float8 GEMMs run (TorchTitan's `float8.emulate`): "auto" emulates them on a CPU (torchao's emulation:
    the same scaled casts to float8, then an ordinary float32 matmul of the dequantized operands) and runs the real
    float8 GEMM (`torch._scaled_mm`) on CUDA; true emulates on any device (an A100 too: float8 numerics, no float8
    speed); false runs `_scaled_mm` everywhere. A CPU's `_scaled_mm` is never a fast kernel, and on a CPU with AMX
    torch hands it to oneDNN's reference float8 matmul (hundreds of times slower than the emulation), so false on a
    CPU is for checking that kernel only and says so at start-up."""

    cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy (parallelisms/data_parallel.py): every parameter shard, its gradient and the AdamW
    state live in host memory (pinned on CUDA); each block's parameters come to the device for its forward and
    backward, its gradients go back, and the optimizer steps on the host (torch's fused CPU AdamW, measured ~3x
    faster than foreach). For models whose state does not fit the GPUs (docs/frontier.md). On a CPU run the host is
    already the device: the same code path and numbers, no memory saved. Not with float8 or pp > 1."""

    def compiles(self, device_type: str = "cuda") -> bool:
        """`compile` resolved for a run on `device_type` ("auto": on for CUDA only)."""
        return device_type == "cuda" if self.compile == "auto" else bool(self.compile)

    def global_batch_rows(self, dp: int) -> int:
        """Rows per optimizer step over all data-parallel ranks."""
        return self.local_batch_size * dp if self.global_batch_size == -1 else self.global_batch_size

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-steps per optimizer step: the global batch over the rows dp ranks take in one micro-step."""
        return 1 if self.global_batch_size == -1 else self.global_batch_size // (self.local_batch_size * dp)


@dataclass
class OptimizerConfig:
    name: OptimizerName = "AdamW"
    """Only AdamW is offered."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 2
    """Linear warmup from ~0 to the peak learning rate over this many steps."""
    decay_type: DecayType = "linear"
    """Decay after warmup: linear | cosine | constant."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""


@dataclass
class ParallelismConfig:
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP outer dimension)."""
    dp_shard: int = -1
    """FSDP2 sharded data-parallel degree; -1 = every rank the other degrees leave."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (ring attention)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism)."""
    cp_load_balancer: LoadBalancer = "zigzag"
    """How sequence chunks are laid out on CP ranks: zigzag | striped | contiguous | documents (per row, documents
    placed by attention work; needs data.document_masking; parallelisms/cp/plan_layout.py). A recipe that names
    none gets documents when data.document_masking is on, else zigzag."""
    cp_impl: CpImpl = "ring"
    """CP attention: ring | allgather (one K/V all-gather) | ulysses (all-to-all over heads) | hybrid (Ulysses in-node,
    ring across nodes) | auto (chosen from heads, degree and topology, and logged). All exact; docs/cp_variants.md."""
    attention_kernel: AttentionKernel = "auto"
    """The CP attention's kernels (parallelisms/cp/kernel_blocks.py): auto (cuDNN's fused attention on CUDA compute
    capability 9.0+, about 2x FlashAttention-2 on Hopper; FlashAttention-2 on older GPUs; the flash-CPU op on CPU) |
    cudnn | flash (torch's FlashAttention-2) | fa3 | fa4 (torch's flash ops switched to FlashAttention-3/4, which
    must be installed: the flash_attn_interface / flash-attn-4 packages). Packed documents use the flash ops' varlen
    calls whatever the choice (cuDNN's varlen backward fails in torch 2.11). Without CP and document masking the
    model's own SDPA call runs, and torch picks its kernel."""
    attention_head_groups: int = 0
    """CP attention runs its K/V heads in at most this many groups, one after another: its float32 gradient
    accumulators, K/V in flight and kernel temporaries then span one group (exact: attention is per head). 0 = by
    size (a group's float32 dQ within 1 GiB: one group up to 64K tokens per rank of an 8B model); 1 = never."""
    attention_sublayer_groups: int = 0
    """The whole attention sublayer (projections, RoPE, CP attention, their gradients) in this many K/V head groups,
    one after another, so q, k, v, their rotations, dQ/dK/dV and the output's gradient span one group
    (parallelisms/sublayer_groups.py; docs/frontier.md). 0 or 1 = off. Must divide model.n_kv_heads; runs under
    CP's ring, allgather or packed documents, eager blocks without TP, float8 or biased projections."""
    fsdp_reshard_after_forward: ReshardPolicy = "default"
    """Free gathered parameters after forward: default (yes, but no under PP) | always | never."""

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP frees gathered parameters after forward: by default yes, but not under PP (each microbatch would
        gather them again)."""
        return {"always": True, "never": False, "default": self.pp == 1}[self.fsdp_reshard_after_forward]
    loss_parallel: bool = True
    """With tp > 1: compute the cross entropy on vocabulary-sharded logits instead of gathering them first."""
    pp_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule: GPipe | 1F1B (one stage per rank) | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble |
    ZBVZeroBubble (several stages per rank; ZBV holds exactly two, V-shaped)."""
    pp_microbatches: int = 0
    """Microbatches each local batch is split into for the pipeline (0 = one row each, i.e. local_batch_size)."""
    pp_layers_per_stage: int = 0
    """Blocks per pipeline stage; the first and last stage take fewer when they do not divide n_layers. 0 = split
    the blocks evenly over pp stages (2 x pp for multi-stage schedules)."""


@dataclass
class ActivationCheckpointConfig:
    mode: ActivationCheckpointMode = "none"
    """none | full (every block) | selective (every `every`-th block) | op (inside every block: save the attention
    kernels' outputs and every other matmul's, recompute the rest, so no attention call runs twice)."""
    every: int = 2
    """With mode = selective: checkpoint every k-th block."""
    offload: bool = False
    """Move each checkpointed block's input to host memory after its forward and back before its recompute (CUDA:
    pinned buffers, copies on a side stream overlapping compute). Needs a mode other than none. Exact."""
    offload_keep_last: int = 0
    """With offload: the inputs of the last this many checkpointed blocks stay on the device. Backward needs the last
    one first, so keeping it costs no device memory at a block's peak (the loss's aside) and saves its host bytes and
    copies; each one more costs one block input at the last block's backward. The dry run measures both. 0 = every
    input offloaded."""
    offload_prefetch: bool = True
    """With offload: bring block i-1's input back while block i recomputes (the copy under compute; two block inputs
    on the device). false: each comes back when its own recompute starts, one on the device and the compute waiting
    for the copy (at 1M tokens per rank of an 8B model 8 GiB less, ~0.3 s of PCIe per block: docs/frontier.md)."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    ramp: list[RampTable] = field(default_factory=list)
    """Context-length ramp stages ([[ramp]] tables, training/ramp.py); empty = one stage, the recipe itself."""
    recipe_path: str = ""
    """The TOML file this config came from (for error messages)."""


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name not in ("ramp", "recipe_path")]


def _choice_fields() -> dict[tuple[str, str], tuple[str, ...]]:
    out = {}
    for section in SECTIONS:
        cls = type(getattr(Config(), section))
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is Literal:
                out[(section, name)] = choices(hint)
    return out


CHOICES = _choice_fields()
"""{(section, key): allowed values} for every Literal-typed field (what the recipe loader checks)."""
