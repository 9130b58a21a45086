"""T = 1 in a continuously refilled batch: tokens 3 and 4 of one prompt's rows against the
target's exact distribution (a chi-square), shared by test_batch (a draft model, the target's
MTP head) and test_batch_dflash.

Rows of PROMPT generate 4 tokens each while other prompts of other lengths come and go
beside them; most samples rewound a rejected draft before token 3. The keyed rule with the
residual p - q must pass; resampling from p (the negative control) must fail the same test.
"""

import random

import mlx.core as mx
from test_exactness import exact_third_and_fourth

from mlx_spec.acceptance import keyed_rule
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.exactness import chi_square
from mlx_spec.sampling import SamplingConfig

SMALL_VOCAB = 8
PROMPT = [3, 1, 4]
SAMPLES = 600
ALPHA = 1e-3


def sample_rows(target, draft, accept, samples, width=6, prompt=PROMPT,
                sampling=SamplingConfig(temp=1.0), **engine_options):
    """Counts of (t3, t4) of `samples` rows of PROMPT, generated 4 tokens each in a batch
    kept `width` rows wide, half of them other prompts of other lengths, every row with
    `sampling`. `engine_options` go to BatchEngine (mtp_weights with draft "mtp")."""
    engine = BatchEngine(target, draft, num_draft_tokens=2, accept=accept, **engine_options)
    rng = random.Random(0)
    ours, counts, started, rewound = set(), {}, 0, 0
    tokens, rejected_early = {}, set()
    while started < samples or engine.busy:
        while started < samples and len(engine.rows) + len(engine.joining) < width:
            if rng.random() < 0.5:
                uid = engine.insert(RowRequest(prompt, 4, sampling))
                ours.add(uid)
                started += 1
            else:
                other = [rng.randrange(SMALL_VOCAB) for _ in range(rng.randrange(1, 7))]
                uid = engine.insert(RowRequest(other, rng.randrange(1, 6), sampling))
            tokens[uid] = []
        for o in engine.step():
            before = len(tokens[o.uid])
            tokens[o.uid] += o.tokens
            if o.num_accepted < o.num_drafted and before + len(o.tokens) < 3:
                rejected_early.add(o.uid)
            if o.finish_reason and o.uid in ours:
                t = tokens[o.uid]
                counts[(t[2], t[3])] = counts.get((t[2], t[3]), 0) + 1
                rewound += o.uid in rejected_early
    return counts, rewound


def check_rows_after_a_rejection(target, draft, residual, exact, min_rewound, prompt=PROMPT,
                                 **engine_options):
    """The chi-square of SAMPLES rows' tokens 3 and 4 passes exactly when `exact`; more than
    `min_rewound` of the rows rewound a rejected draft before token 3."""
    mx.random.seed(0)
    counts, rewound = sample_rows(target, draft, keyed_rule(residual), SAMPLES, prompt=prompt,
                                  **engine_options)
    assert sum(counts.values()) == SAMPLES
    assert rewound > min_rewound, rewound
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(
        target, prompt, SamplingConfig(temp=1.0)))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)
