"""One rank of tests/test_context_parallel.py, started by torchrun with 2 gloo ranks.

    torchrun --standalone --nproc-per-node 2 tests/cp_worker.py RUN_YAML

1. The model on rows split over the two ranks (each holds chunks r and 3−r of 4, with their
   global positions; K/V all-gathered) against the same model on whole rows, for each kind of
   mask: plain causal, packed documents, a sliding window on some layers with their own RoPE
   base, soft-capped scores, and packed documents under selective activation checkpointing
   (whose recompute gathers K/V again): the same summed loss (over both ranks) and the same gradients
   (summed over both ranks, as data parallelism reduces them).
2. This rank of `lmforge train -f RUN_YAML` (context_parallel: 2), in the same process group.
"""

from __future__ import annotations

import copy
import sys

import torch

from lmforge.cli.main import main
from lmforge.config.model import ModelConfig
from lmforge.data.batch import Batch
from lmforge.distributed.context_parallel import chunk_positions, sequence_group
from lmforge.distributed.dist import all_reduce_sum, init_distributed
from lmforge.distributed.parallelize import apply_activation_checkpointing
from lmforge.models import build_model

BASE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)
MASKS = {
    "causal": {},
    "documents": {},
    "window": dict(sliding_window=5, sliding_window_pattern=2, rope_theta_local=100.0),
    "softcap": dict(attn_softcap=2.0),
    "checkpointed": {},  # selective activation checkpointing: the recompute gathers K/V again
}


def check_masks(dist) -> None:
    group = sequence_group(2, dist.world_size, dist.device)
    tokens = torch.randint(1, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 20]] = 0  # end-of-text (id 0) inside rows: three documents in row 0, two in row 1
    tokens[1, 11] = 0
    for name, extra in MASKS.items():
        torch.manual_seed(0)
        whole = build_model(ModelConfig(**BASE, **extra))
        split = copy.deepcopy(whole)
        split.sequence_group = group
        if name == "checkpointed":
            apply_activation_checkpointing(split, "selective")
        batch = Batch.from_tokens(tokens, eos_id=0 if name in ("documents", "softcap", "checkpointed") else None)
        expected = whole.training_loss(batch.input_ids, batch.targets, doc_ids=batch.doc_ids).ce_sum
        expected.backward()
        part = batch.part(chunk_positions(32, 2, group.rank))
        got = split.training_loss(part.input_ids, part.targets, doc_ids=part.doc_ids, positions=part.positions).ce_sum
        got.backward()
        torch.testing.assert_close(all_reduce_sum(got.detach().clone()), expected.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        for (key, a), b in zip(whole.named_parameters(), split.parameters()):
            torch.testing.assert_close(all_reduce_sum(b.grad.clone()), a.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} {key}: {m}")


if __name__ == "__main__":
    run_yaml = sys.argv[1]
    dist = init_distributed("cpu")  # `lmforge train` below reuses this process group
    check_masks(dist)
    print("masks: sharded rows match whole rows")
    sys.exit(main(["train", "-f", run_yaml]))
