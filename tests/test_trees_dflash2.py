"""Token trees from a DFlash2 drafter (issue 66): its selector's walk the spine, and beside
spine row i siblings from q_i, the selector's distribution over row i's candidates given the
spine's draft before it (the next-best candidates at T = 0, i.i.d. draws at T > 0); siblings
are leaves.

- greedy parity over 120 tokens with 3 x 2 and 4 x 3 trees (a sibling kept at least once)
  and with tree=None, the policy's width alternating chains and trees;
- the trees are real: tree rounds verify more nodes than their depth, and greedy siblings
  are the row's other candidates, none the spine's own token;
- chi-square at T = 1 of the first two tokens and of tokens 3 and 4 after mid-generation
  rejections; the naive rule (each candidate accepted with min(1, p/q) on its own) fails each.
"""

import mlx.core as mx
import pytest

from dflash_tiny import make_dflash2
from families import plain_greedy
from test_dflash2 import EXTRAS
from test_trees_heads import (ALPHA, PROMPT, Alternating, check_greedy, check_later_pairs,
                              naive)
from tiny import make_llama

from mlx_spec.exactness import check_exactness
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random llama and a random DFlash2 drafter (seed 2: its greedy 3 x 2 and 4 x 3 trees
    keep a sibling in 4 rounds of 120 tokens each; most seeds' random drafts match the target
    too seldom to show one)."""
    target = make_llama(layers=4, seed=0)
    drafter = make_dflash2(tmp_path_factory.mktemp("tree-dflash2") / "d", 48, [1, 2],
                           block_size=6, seed=2)
    return target, drafter


@pytest.mark.parametrize("shape", [(3, 2), (4, 3)])
def test_dflash2_trees_keep_the_target_s_greedy_text(pair, shape):
    check_greedy(*pair, shape)


def test_with_tree_none_the_policy_s_width_makes_dflash2_trees(pair):
    target, drafter = pair
    policy = Alternating()
    rounds = list(speculative_generate_step(PROMPT, target, drafter, max_tokens=60,
                                            num_draft_tokens=None, policy=policy,
                                            calibration=None, prompt_lookup=False))
    assert policy.allowed == {"dflash": 3}
    assert 0 < policy.tree_rounds < len(rounds)  # chains and trees both ran
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPT, 60)


def test_a_dflash2_tree_round_has_siblings(pair, monkeypatch):
    """Every 3 x 3 tree verifies depth x 3 nodes, and at T = 0 each depth's siblings are
    distinct candidates of that row other than the spine's token: trees, not chains that
    fell back, and the kept scores are the walk's (given the spine's draft before)."""
    import mlx_spec.loop as loop

    proposals, tree_round = [], loop.tree_round

    def spy(decoder, proposal):  # each proposal with its rows' kept log q (depth, V)
        proposals.append((proposal, proposal.drafter.base.kept_logprobs))
        return tree_round(decoder, proposal)

    monkeypatch.setattr(loop, "tree_round", spy)
    target, drafter = pair
    rounds = list(speculative_generate_step(PROMPT, target, drafter, max_tokens=40,
                                            num_draft_tokens=3, tree=(3, 3), calibration=None,
                                            prompt_lookup=False))
    trees = [r for r in rounds if r.tree_nodes]
    assert trees and all(r.tree_nodes == 3 * r.num_drafted for r in trees)
    for proposal, kept in proposals:
        tokens = proposal.tokens.tolist()
        support = mx.isfinite(kept)  # (depth, V): each row's candidates
        for depth, spine in enumerate(proposal.spine):
            siblings = tokens[spine:spine + 2]  # node `spine` is tokens[spine - 1]
            assert tokens[spine - 1] not in siblings and len(set(siblings)) == 2
            assert all(support[depth, t].item() for t in [tokens[spine - 1]] + siblings)
    assert len(proposals) == len(trees)


# --- T = 1 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A target over 8 tokens and a drafter choosing among 3 of them per row."""
    target = make_llama(vocab_size=8, layers=4, seed=0)
    drafter = make_dflash2(tmp_path_factory.mktemp("tree-dflash2-8") / "d", 48, [1, 2],
                           block_size=6, vocab_size=8, mask_token_id=7, selector_top_k=3,
                           extra=EXTRAS)
    return target, drafter


# The suite is near its time budget: few samples where the statistics allow (a sample costs
# ~13-20 ms here). Tokens 1-2: the naive rule fails at 100 samples with p < 5e-6 for each of
# seeds 0, 2, 3, 4 (statistic 30-62 on 4 dof); a test that catches it at 100 catches it at 200.
# Tokens 3-4 with 2 x 4 trees (wider than the 3 candidates: duplicates, drawn with
# replacement): the naive rule's noncentrality ~28 at 150 samples (seeds 2-4: statistic
# 24-41 on 7 dof), so ~37 at 200, missed at alpha 1e-3 with probability ~6%. Each exact test
# fails falsely with probability 1e-3 (alpha) whatever the count; every run here is seeded.
FIRST_SAMPLES = 200
FIRST_CONTROL_SAMPLES = 100
LATER_SAMPLES = 200


@pytest.mark.parametrize("control", [False, True], ids=["exact", "naive-rule"])
def test_dflash2_trees_give_the_first_two_tokens_at_t1(small, control, monkeypatch):
    """2 x 3 trees: the first two tokens come from one tree round's root and spine node."""
    if control:
        naive(monkeypatch)
    target, drafter = small
    result = check_exactness(target, drafter, [1, 2, 3, 4, 5, 6, 7], SamplingConfig(temp=1.0),
                             samples=FIRST_CONTROL_SAMPLES if control else FIRST_SAMPLES,
                             num_draft_tokens=2, alpha=ALPHA, seed=0, tree=(2, 3))
    print(f"dflash2 trees t1,t2 control={control}: chi2={result.statistic:.1f} "
          f"dof={result.dof} p={result.p_value:.3g}")
    assert result.passed != control, result


@pytest.mark.parametrize("control", [False, True], ids=["exact", "naive-rule"])
def test_dflash2_trees_give_tokens_3_and_4_after_rejections(small, control, monkeypatch):
    """2 x 4 trees: most samples rejected part of a tree before token 3, so tokens 3 and 4
    come from a block after the accepted path."""
    check_later_pairs(*small, [3, 1, 4], LATER_SAMPLES, (2, 4), control, monkeypatch)
