"""Needle rows under CP 2 give the answer log-probabilities of CP 1 within 1e-5.

Comparing argmax answers of a barely trained model (the slow NIAH test) mostly compares digit priors; log-
probabilities of every answer token move with every attention weight. The model is random with sharp attention
(query / key weights scaled up), so where the needle sits matters to the answer's log-probabilities; the rows are
data/niah.py's at three depths, sharded by `context_parallel` on 2 gloo ranks (zigzag) exactly as in training; the
reference is one process on the full rows."""
import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(180)
SEQ, DEPTHS, BOUND = 512, (0.0, 0.5, 1.0), 1e-5


class ByteTokenizer:
    """One token per byte: every digit is one token, as the needle task requires."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _model():
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32))
    model.init_weights(0)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(6)
            block.attention.wk.weight.mul_(6)
    return model.eval()


def _batch():
    import numpy as np

    from data.niah import NiahRows

    fields = [NiahRows(ByteTokenizer(), None, seq_len=SEQ, seed=3, depth=d).row_fields(i)
              for i, d in enumerate(DEPTHS)]
    return {k: torch.from_numpy(np.stack([f[k] for f in fields])) for k in fields[0]}


def answer_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(answer token) at every labelled position, in row order."""
    from data.labels import IGNORE_INDEX

    answer = labels != IGNORE_INDEX
    return torch.log_softmax(logits.double(), dim=-1)[answer].gather(1, labels[answer][:, None]).squeeze(1)


def _cp_body(rank, size):
    import torch.distributed as dist

    from parallelisms.context_parallel import context_parallel, unshard_sequence

    model, batch = _model(), _batch()
    buffers = [batch["input_ids"].clone(), batch["position_ids"].clone()]
    with torch.no_grad(), context_parallel(dist.group.WORLD, buffers, [1, 1], load_balancer="zigzag"):
        local = model(buffers[0], buffers[1])
    logits = unshard_sequence(local.contiguous(), 1, dist.group.WORLD, load_balancer="zigzag")
    return answer_log_probs(logits, batch["labels"]).tolist()


def test_niah_answer_log_probs_under_cp2_equal_cp1():
    batch = _batch()
    with torch.no_grad():
        reference = answer_log_probs(_model()(batch["input_ids"], batch["position_ids"]), batch["labels"])
    assert reference.numel() == len(DEPTHS) * 7  # 7 answer digits per row
    per_rank = run_ranks(_cp_body, 2, timeout=150)
    for got in per_rank:
        gap = (torch.tensor(got, dtype=torch.float64) - reference).abs().max().item()
        print(f"NIAH answer log-probs, cp 2 vs cp 1: max |diff| {gap:.1e} (spread of the values "
              f"{reference.min().item():.2f}..{reference.max().item():.2f})")
        assert gap <= BOUND
    assert reference.std() > 0.05  # the answer tokens' log-probs differ: a test of positions, not of a flat prior
