"""A target too large for one Mac, sharded over several with MLX's distributed engine.

Run the same program on every rank with `mlx.launch`:

    target, tokenizer, draft = load_sharded(TARGET, DRAFT)   # target sharded, draft whole
    mlx_spec.generate(target, tokenizer, prompt, draft_model=draft)

`load_sharded` (loading.py) shards the target with mlx-lm's sharded loading
(tensor parallel or pipeline) and marks it; the generation API sees the mark
and keeps the ranks in agreement (agreement.py): every rank takes rank 0's
drafts, accept decisions and round times, carried in each round's own graph,
so the loop keeps one host sync per round.
"""

from .agreement import AgreedDrafter, AgreedPolicy, RankAgreement, agree_across_ranks
from .group import launched, launched_group, sharding_group
from .loading import SHARDINGS, check_draft_fits, load_sharded

__all__ = ["AgreedDrafter", "AgreedPolicy", "RankAgreement", "agree_across_ranks", "launched",
           "launched_group", "sharding_group", "SHARDINGS", "check_draft_fits", "load_sharded"]
