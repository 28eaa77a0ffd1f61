import json

from training.metrics import MetricsLogger


def record(loss):
    return {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0, "mfu": 0.1, "memory": 0.5}


def test_resume_replaces_the_replayed_steps(tmp_path):
    first = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True)
    for step in range(1, 5):
        first.log(step, record(float(step)))
    first.close()  # died after step 4; the newest checkpoint is step 2
    second = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True, start_step=2)
    for step in range(3, 7):
        second.log(step, record(10.0 + step))
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]
