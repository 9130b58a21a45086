"""Batched speculative decoding: many requests in one verify pass, joining and leaving
between rounds (the server's engine, and `batch_generate`).

    rows.py     one request's host state: tokens, budget, sampling, its own random key
    kv.py       one model's cache for all rows, with per-row rewind (mlx-lm's BatchKVCache)
    drafts.py   the draft model drafting for every row in one pass per position
    cross.py    a draft of another tokenizer: a drafter of its own for each row
    verify.py   the batched verify pass and each row's own acceptance: one sync per round
    plain.py    rounds where no row drafts, queued back to back (the next step dispatched first)
    trees.py    token trees: each row's own tree verified in the same one pass
    policy.py   the batch's k, from its measured goodput (down to 0: plain batched decoding)
    engine.py   continuous batching: chunked prefill, rounds, rows leaving with their caches
    api.py      batch_generate, shaped like mlx-lm's
"""

from .engine import BatchEngine
from .kv import batchable
from .rows import RowOutput, RowRequest

__all__ = ["BatchEngine", "RowOutput", "RowRequest", "batchable"]
