"""The dry run measures the trainer's own step: both call training/step.py's `micro_step`, looked up at call time.

Each check runs in a fresh process (a trainer and a memory probe each own a default process group), replaces
`training.step.micro_step` with a wrapper that counts its calls and passes them on, and runs the real caller.
"""
import concurrent.futures
import os
import sys
import tempfile

from tests.distributed import fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model.n_layers", "2", "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--training.steps", "1", "--metrics.enable_tensorboard", "false"]


def _in_fresh_process(fn, *args, timeout=240):
    ctx = fresh_process_context()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def _count_micro_steps() -> list:
    """Wraps training.step.micro_step; returns the list its calls are recorded in."""
    from training import step

    calls, real = [], step.micro_step

    def counted(setup, batch, global_tokens):
        calls.append((tuple(batch["input_ids"].shape), global_tokens))
        return real(setup, batch, global_tokens)

    step.micro_step = counted
    return calls


def _probe_calls(overrides):
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from config.recipe import load_config
    from training.planning.memory_probe import measure_rank

    calls = _count_micro_steps()
    measure_rank(load_config(os.path.join(ROOT, "recipes", "debug.toml"), overrides), 2)
    return calls


def _trainer_calls(overrides):
    sys.path.insert(0, ROOT)
    from tests.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    from config.recipe import load_config
    from training.trainer import Trainer

    calls = _count_micro_steps()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(load_config(os.path.join(ROOT, "recipes", "debug.toml"),
                                      overrides + ["--job.dump_folder", out]))
        try:
            trainer.train_step(trainer._step_batches(iter(trainer.dataloader)))  # a step, planned in the workers
        finally:
            trainer.close()
    return calls


def test_the_memory_probe_runs_the_trainers_micro_step():
    """One warm-up-free measured micro-step over a (2, 128) local batch, divided by 2 ranks x 2 rows x 128 tokens."""
    assert _in_fresh_process(_probe_calls, TINY) == [((2, 128), 2 * 2 * 128)]


def test_with_accumulation_the_probe_runs_two_micro_steps():
    """global batch 8 on 2 ranks of 2 rows: the probe runs one micro-step, then measures the next on its gradients."""
    calls = _in_fresh_process(_probe_calls, TINY + ["--training.global_batch_size", "8"])
    assert calls == [((2, 128), 8 * 128)] * 2


def test_the_trainer_runs_the_same_micro_step():
    assert _in_fresh_process(_trainer_calls, TINY + ["--parallelism.dp_shard", "1"]) == [((2, 128), 2 * 128)]
