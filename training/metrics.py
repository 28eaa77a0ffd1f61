"""One logged step goes to three places: a console progress line, <dump>/metrics.jsonl and TensorBoard (<dump>/tb).

Only the first rank writes; callers reduce the numbers over ranks before logging.
"""
from __future__ import annotations

import json
import os
import time


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _drop_records_after(path: str, step: int) -> None:
    """Keeps the records of steps <= `step` (all of them when starting fresh at step 0 in a new folder)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        with open(path, "w") as f:
            f.writelines(kept)


class MetricsLogger:
    def __init__(self, dump_folder: str, total_steps: int, enable_tensorboard: bool, is_writer: bool,
                 start_step: int = 0):
        self.total_steps = total_steps
        self.is_writer = is_writer
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.jsonl = None
        self.tb = None
        if not is_writer:
            return
        os.makedirs(dump_folder, exist_ok=True)
        path = os.path.join(dump_folder, "metrics.jsonl")
        _drop_records_after(path, start_step)  # a resumed run replays the steps after its checkpoint
        self.jsonl = open(path, "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(dump_folder, "tb"), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, record: dict) -> None:
        """`record` holds the CONTRACT fields (loss, lr, grad_norm, tokens_per_sec, mfu, seq_len, cp,
        global_batch_size, memory, ...); every number also becomes a TensorBoard scalar."""
        if not self.is_writer:
            return
        record = {"step": step, **record}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, dict):  # e.g. source_tokens: one curve per source (numbers only)
                    for name, item in value.items():
                        if isinstance(item, (int, float)):
                            self.tb.add_scalar(f"{key}/{name}", item, step)
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / max(1, done) * (self.total_steps - step)
        print(f"step {step:>5}/{self.total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
              f"gnorm {record['grad_norm']:.3f}  tok/s {record['tokens_per_sec']:,.0f}  mfu {100 * record['mfu']:.1f}%  "
              f"mem {record['memory']:.2f}GiB  eta {format_eta(eta)}", flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
