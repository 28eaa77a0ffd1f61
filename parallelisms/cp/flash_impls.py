"""Which FlashAttention implementation torch's CUDA flash ops run: FA2 (torch's own), or FA3 / FA4 re-registered
through `torch.nn.attention` for the kernel families "fa3" / "fa4" (kernel_blocks.FLASH_IMPLEMENTATIONS). The switch
is process-wide, so the trainer makes it once per rank at setup and the benches scope it per timed family."""
from __future__ import annotations

import contextlib

from parallelisms.cp.kernel_blocks import FLASH_IMPLEMENTATIONS


def activate_flash_implementation(kernel: str) -> None:
    """Makes torch's CUDA flash ops the family's (process-wide, once per rank at setup): FA3/FA4 re-registered for
    "fa3"/"fa4"; for any other family torch's own FA2 again, should an earlier call have switched them."""
    import torch.nn.attention as attention

    current = attention.current_flash_attention_impl()
    if kernel in FLASH_IMPLEMENTATIONS:
        name = FLASH_IMPLEMENTATIONS[kernel][0]
        if current != name:
            attention.activate_flash_attention_impl(name)
    elif current is not None:
        attention.restore_flash_attention_impl(_raise_warn=False)


@contextlib.contextmanager
def flash_implementation(kernel: str):
    """`activate_flash_implementation` for a scope (the benches time one family after another): torch's flash ops
    are back to what they were on exit."""
    import torch.nn.attention as attention

    before = attention.current_flash_attention_impl()
    activate_flash_implementation(kernel)
    try:
        yield
    finally:
        if attention.current_flash_attention_impl() != before:
            if before is None:
                attention.restore_flash_attention_impl(_raise_warn=False)
            else:
                attention.activate_flash_attention_impl(before)
