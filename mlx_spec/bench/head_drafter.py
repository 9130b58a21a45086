"""The bench's EAGLE-3 path: a head that drafts from the target's hidden states, step by step.

An EAGLE-3 head drafts k tokens in k chained steps, as a draft model does, so the bench's
per-token cost model applies with the head's step as the draft step (`head_cost`): the head
over its own output and the token it drafted, after a context of the target's fused taps
(`calibrate.eagle3_step_seconds`, the step `mlx-spec tune` measures). What differs from a draft
model: it cannot decode alone, so its runs go through the loop from the prompt, whose prefill
hands it the prompt's taps (`endtoend.compare_from_prompt`); mlx-lm's speculative mode cannot
run it, and its width is the target's, so the synthetic targets of other sizes do not apply
(`SKIPPED`); it has no verify curve of its own.
"""

from __future__ import annotations

from typing import Callable

from ..memory import model_bytes
from .calibrate import eagle3_step_seconds
from .forward import ModelCost
from .timing import ratio

KIND = "EAGLE-3 head"
SKIPPED = {
    "size scaling": ("an EAGLE-3 head has the target's width and reads its hidden states, so its "
                     "step cannot be held fixed while a synthetic target of another size grows"),
    "mlx-lm speculative": ("mlx-lm's speculative mode cannot run an EAGLE-3 head (it reads the "
                           "target's hidden states): the mlx-lm column reads n/a"),
}


def head_cost(target_model, head, read_gbs: float, context_length: int,
              repeats: int) -> ModelCost:
    """The head as the draft row of the per-model table: its chained step after
    `context_length` tokens of the target's taps (its own KV cache, rewound by trimming)."""
    seconds = eagle3_step_seconds(target_model, head, context_length, repeats)
    weight_bytes = model_bytes(head)
    share = ratio(weight_bytes / seconds / 1e9, read_gbs) if seconds else 0.0
    return ModelCost("draft", weight_bytes, context_length, seconds, share,
                     cache_kinds="1 KVCache (the head's own)", rewind="trim (host metadata)")


def step_seconds(target_model, head, repeats: int) -> Callable[[int], float]:
    """The head's step after a context of a given length (the context scaling's draft step)."""
    return lambda length: eagle3_step_seconds(target_model, head, length, repeats)
