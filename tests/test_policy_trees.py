"""The policy chooses the tree width: E_s(k, w) / T_s(k w) (docs/drafting.md, "The policy").

Simulated machines (a round of depth k and width w costs 1 + k w v + k d plain steps: k w
nodes verified, k draft steps; siblings cost no draft step) with i.i.d. spine acceptance a
and a sibling kept where the spine's draft was rejected with chance 1 - (1 - beta)^(w - 1).
The bars were set before the first run: at least 0.9 of the best fixed shape (plain, every
chain and every tree up to 8 x 3, in expectation); no tree at all where verifying costs a
pass a node; a chain-only policy fails the bar where trees win (the negative control). Then
the loop: with tree=None a policy that chooses a width gets trees, token for token the
target's own greedy text.
"""

import random

import pytest

from mlx_spec.loop import Round
from mlx_spec.policy import AdaptivePolicy, FixedPolicy


def expected(a, k, rescue):
    tokens, survive = 1.0, 1.0
    for _ in range(k):
        tokens += survive * (a + (1.0 - a) * rescue)
        survive *= a
    return tokens


def rescue(beta, w):
    return 0.0 if w <= 1 else 1.0 - (1.0 - beta) ** (w - 1)


def best_fixed(a, beta, v, d, widths=(1, 2, 3)):
    return max([1.0] + [expected(a, k, rescue(beta, w)) / (1.0 + k * w * v + k * d)
                        for w in widths for k in range(1, 9)])


def simulate(policy, a, beta, v, d, tokens=800, seed=0, trees=True, told_v=None):
    """(tokens per plain-step time, rounds that were trees, rounds) over `tokens` tokens;
    `told_v`: the prefill's per-token time the policy is told, if not the true v."""
    rng = random.Random(seed)
    policy.observe_prefill(100, 100 * (v if told_v is None else told_v))
    policy.observe_draft_step("draft", d)
    if trees:
        policy.allow_trees("draft", 3)
    emitted, elapsed, tree_rounds, rounds, opens = 0, 0.0, 0, 0, True
    while emitted < tokens:
        k = policy.proposal_length("draft")
        if k == 0:
            for i in range(policy.plain_steps()):
                policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), 1.0)
                emitted, elapsed = emitted + 1, elapsed + 1.0
            continue
        w = policy.tree_width("draft") if trees else 1
        spine = sibling = 0
        while spine < k and rng.random() < a:
            spine += 1
        if spine < k and rng.random() < rescue(beta, w):
            sibling = 1
        kept = spine + sibling
        seconds = 1.0 + k * w * v + k * d
        if w > 1:
            round_ = Round([0] * (kept + 1), k, kept, "draft", None, tree_nodes=k * w,
                           tree_width=w, spine_kept=spine)
            tree_rounds += 1
        else:
            round_ = Round([0] * (kept + 1), k, kept, "draft", None)
        policy.observe(round_, seconds)
        emitted, elapsed, rounds = emitted + kept + 1, elapsed + seconds, rounds + 1
    return emitted / elapsed, tree_rounds, rounds


def median_of_three(make_policy, *case, trees=True, told_v=None):
    runs = [simulate(make_policy(), *case, seed=seed, trees=trees, told_v=told_v)
            for seed in range(3)]
    return sorted(runs)[1]


def plain_timed():
    policy = AdaptivePolicy()
    for i in range(4):
        policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), 1.0)
    return policy


@pytest.mark.parametrize("a,beta", [(0.6, 0.5), (0.5, 0.8), (0.7, 0.6)])
def test_on_a_flat_verify_curve_trees_are_chosen_and_pay(a, beta):
    """A GPU-like machine (v = 0.02, d = 0.05): the best shape is a tree; the policy gets at
    least 0.9 of it and most of its rounds are trees."""
    case = (a, beta, 0.02, 0.05)
    rate, tree_rounds, rounds = median_of_three(plain_timed, *case)
    assert best_fixed(*case) > best_fixed(*case, widths=(1,))  # a tree is the best shape
    assert rate >= 0.9 * best_fixed(*case), (rate, best_fixed(*case))
    assert tree_rounds > rounds / 2


@pytest.mark.parametrize("a,beta", [(0.9, 0.5), (0.7, 0.9)])
def test_where_a_node_costs_a_pass_no_tree_is_ever_tried(a, beta):
    """A netlib-like CPU (a node costs half a plain pass): even with the hopeful sibling
    chance a wider tree would lose, so none is tried, and the chain policy's bar holds."""
    case = (a, beta, 0.5, 0.05)
    rate, tree_rounds, _ = median_of_three(plain_timed, *case)
    assert tree_rounds == 0
    assert rate >= 0.9 * best_fixed(*case, widths=(1,)), rate


def test_siblings_that_are_never_kept_are_dropped_for_the_chain():
    """On the flat machine with beta = 0 a few tree trials, then chains: 0.9 of the best chain,
    trees in at most a tenth of the rounds."""
    case = (0.7, 0.0, 0.02, 0.05)
    rate, tree_rounds, rounds = median_of_three(plain_timed, *case)
    assert rate >= 0.9 * best_fixed(*case)
    assert tree_rounds <= rounds / 10, (tree_rounds, rounds)


def test_a_node_dearer_than_the_prefill_said_is_learned_from_the_trials():
    """Told a node costs 0.02 (a prefill that batches well) where it costs 0.5 (a verify pass
    per node, as float16 on a CPU): the first trials' seconds teach v_s and trees stop (at
    most three tree rounds in 800 tokens), within 0.9 of the best fixed shape."""
    case = (0.7, 0.6, 0.5, 0.05)
    runs = [simulate(plain_timed(), *case, seed=seed, told_v=0.02) for seed in range(3)]
    assert all(tree_rounds <= 3 for _, tree_rounds, _ in runs), runs
    assert sorted(runs)[1][0] >= 0.9 * best_fixed(*case), runs


def test_the_negative_control_a_chain_only_policy_fails_the_bar():
    """The same policy told nothing of trees (chains only) where a tree wins by a third."""
    case = (0.5, 0.8, 0.02, 0.05)
    rate, _, _ = median_of_three(plain_timed, *case, trees=False)
    assert rate < 0.9 * best_fixed(*case)


# --- the loop: a width chosen by the policy ---------------------------------------------


class WidePolicy(FixedPolicy):
    """k = 3, and width 2 for every source that can tree: the loop's side of the choice."""

    def __init__(self):
        super().__init__(3)
        self.allowed, self.tree_rounds = {}, 0

    def observe(self, round_, seconds):
        self.tree_rounds += round_.tree_nodes > 0

    def allow_trees(self, source, max_width):
        self.allowed[source] = max_width

    def tree_width(self, source):
        return 2


@pytest.mark.parametrize("temp", [0.0, 0.7])
def test_with_tree_none_the_policys_width_makes_tree_rounds_with_the_targets_text(temp):
    from tiny import make_llama, perturbed

    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.sampling import SamplingConfig

    target = make_llama(vocab_size=48, seed=5)
    draft = perturbed(target, noise=0.3)
    prompt = [1, 5, 9, 2, 7, 5, 9]
    sampling = SamplingConfig(temp=temp)
    policy = WidePolicy()
    got = [t for r in speculative_generate_step(prompt, target, draft, max_tokens=40,
                                                 sampling=sampling, policy=policy,
                                                 prompt_lookup=False) for t in r.tokens]
    assert policy.allowed == {"draft": 3} and policy.tree_rounds > 5
    if temp == 0.0:
        alone = [t for r in speculative_generate_step(prompt, target, None, max_tokens=40,
                                                       prompt_lookup=False) for t in r.tokens]
        assert got == alone
    assert len(got) == 40
