"""The prompt look of a batch row decoding alone: the value a call of its own hands its policy.

A sampled request with a draft model, alone in the batch, gets its policy set up as a call
gets it (`BatchEngine._single_policy`), the prompt look included: the draft's acceptance on
the prompt's last positions. Each value is checked against the same independent computation
as the loop's (test_prompt_look.py): the target and the draft from scratch over the whole
prompt, the rows picked by hand, sum_x min(p, q) in numpy; an off-by-one fails.
"""

import mlx.core as mx
import pytest

from test_prompt_look import looked, numpy_chances, pair, prompt_of  # noqa: F401 (a fixture)

from mlx_spec import prompt_look
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.sampling import SamplingConfig


def run(target, draft, prompts, temp=0.7, step=512, **request):
    engine = BatchEngine(target, draft, prefill_step_size=step)
    for prompt in prompts:
        engine.insert(RowRequest(prompt, 8, SamplingConfig(temp=temp), **request))
    while engine.busy:
        engine.step()
    return engine


@pytest.mark.parametrize("length,step,rows", [(50, 512, prompt_look.ROWS), (40, 16, 7)])
def test_a_row_alone_looks_as_a_call_does(pair, monkeypatch, length, step, rows):  # noqa: F811
    """Chunks 16, 16, 7: the last chunk's rows, as the loop's look takes them."""
    target, draft = pair
    prompt = prompt_of(length)
    seen = looked(monkeypatch)
    run(target, draft, [prompt], step=step)
    assert [(s, r) for s, _, r in seen] == [("draft", rows)]
    x = mx.array([prompt[:-1]])
    expected = numpy_chances(target(x)[0, -rows:], draft(x)[0, -rows:], 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
    shifted = numpy_chances(target(x)[0, 1 - rows:], draft(x)[0, -rows:-1], 0.7).mean()
    assert abs(shifted - expected) > 1e-3  # (the check can tell an off-by-one)


def test_the_batch_and_the_loop_hand_the_policy_the_same_look(pair, monkeypatch):  # noqa: F811
    """The same prompt, a call of its own (the loop) and a batch row alone: the same value."""
    from test_prompt_look import decode

    target, draft = pair
    prompt = prompt_of(45, seed=3)
    seen = looked(monkeypatch)
    decode(target, draft, prompt)
    run(target, draft, [prompt])
    assert len(seen) == 2 and seen[0][2] == seen[1][2] == prompt_look.ROWS
    assert seen[0][1] == pytest.approx(seen[1][1], abs=1e-4)


def test_a_row_alone_drafting_with_the_mtp_head_looks_as_a_call(tmp_path, monkeypatch):
    """The target's MTP head: its outputs at the prefill's pairs (h_i, x_{i+1}) against the
    target's own predictions of the same tokens, as a call's look (test_prompt_look's MTP
    test checks that one against numpy): a row alone hands its policy the same value, over the
    same rows, under the source "mtp"."""
    from test_mtp import PROMPT as MTP_PROMPT, make_target, mtp_params, write_original
    from test_prompt_look import decode

    target = make_target("qwen3_5")
    weights = write_original(tmp_path / "mtp", target, mtp_params(target))
    prompt = MTP_PROMPT + prompt_of(12, seed=3)
    seen = looked(monkeypatch)
    decode(target, "mtp", prompt, mtp_weights=str(weights))
    engine = BatchEngine(target, "mtp", mtp_weights=str(weights))
    engine.insert(RowRequest(prompt, 8, SamplingConfig(temp=0.7)))
    while engine.busy:
        engine.step()
    assert len(seen) == 2 and seen[0][0] == seen[1][0] == "mtp"
    assert seen[0][2] == seen[1][2] == len(prompt) - 2
    assert seen[1][1] == pytest.approx(seen[0][1], abs=1e-4)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_row_alone_drafting_with_a_block_drafter_looks_as_a_call(tmp_path, monkeypatch, kind):
    """A DFlash drafter's look (its first draft row anchored at each of the prompt's last
    positions, over the context before it) and a DFlash2 drafter's (the selector's q there):
    a row alone hands its policy what a call hands its own (test_prompt_look checks those
    against dense numpy forwards), over the same rows, under the source "dflash"."""
    from dflash_tiny import make_dflash, make_dflash2
    from test_dflash2 import EXTRAS
    from test_prompt_look import decode
    from tiny import make_llama

    target = make_llama(layers=4, seed=0)
    drafter = make_dflash(tmp_path / kind, 48, [1, 3], block_size=5) if kind == "dflash" \
        else make_dflash2(tmp_path / kind, 48, [1, 3], block_size=5, conv_kernel_size=3,
                          extra=EXTRAS)
    prompt = prompt_of(14, seed=4)
    seen = looked(monkeypatch)
    decode(target, drafter, prompt)
    run(target, drafter, [prompt])
    assert len(seen) == 2 and seen[0][0] == seen[1][0] == "dflash"
    assert seen[0][2] == seen[1][2] == len(prompt) - 2
    assert seen[1][1] == pytest.approx(seen[0][1], abs=1e-4)


def test_a_row_alone_looks_after_its_first_round_whole_as_a_call(pair, monkeypatch):  # noqa: F811
    """A call's first round is its policy's plain trial (TRIAL_STEPS steps, no calibration), and
    its look comes after that whole block, the block's steps timed (look_rows reads them); a
    row alone looks at the same point, not after the block's first step."""
    from test_prompt_look import decode

    from mlx_spec.policy import TRIAL_STEPS, AdaptivePolicy

    target, draft = pair
    looked(monkeypatch)
    plain, at = [0], []
    observe, look = AdaptivePolicy.observe, AdaptivePolicy.observe_prompt_look

    def counting(self, round_, seconds):
        plain[0] += round_.num_drafted == 0
        return observe(self, round_, seconds)

    def record(self, *args, **options):
        at.append(plain[0])
        return look(self, *args, **options)
    monkeypatch.setattr(AdaptivePolicy, "observe", counting)
    monkeypatch.setattr(AdaptivePolicy, "observe_prompt_look", record)
    prompt = prompt_of(40, seed=4)
    decode(target, draft, prompt, max_tokens=12)
    plain[0] = 0
    run(target, draft, [prompt], prompt_lookup=False)
    assert at == [TRIAL_STEPS, TRIAL_STEPS]


def test_a_row_alone_asks_for_its_look_s_rows_as_a_call_does(pair, monkeypatch):  # noqa: F811
    """policy.look_rows is handed the prefill's time a token, the reply's length and the rows
    kept, with the plain step's time known (the trial block's), by a call and a row alone."""
    from test_prompt_look import decode

    from mlx_spec.policy import AdaptivePolicy

    target, draft = pair
    looked(monkeypatch)
    asked = []

    def affordable(self, per_token, tokens, most):
        asked.append((per_token > 0, self.plain_seconds is not None, tokens, most))
        return most
    monkeypatch.setattr(AdaptivePolicy, "look_rows", affordable)
    prompt = prompt_of(40, seed=6)
    decode(target, draft, prompt, max_tokens=12)
    engine = BatchEngine(target, draft)
    engine.insert(RowRequest(prompt, 12, SamplingConfig(temp=0.7), prompt_lookup=False))
    while engine.busy:
        engine.step()
    assert asked == [(True, True, 12, prompt_look.ROWS)] * 2


def test_a_row_alone_is_told_its_drafts_prefill_as_a_call_is(pair, monkeypatch):  # noqa: F811
    """What the draft's reading of the prompt cost, a token: the catch-up price its policy
    discounts a round after an off period by. A sampled call's draft reads the prompt at once
    (the look reads its prefill) and its policy is told; a row alone's is told too, over as
    many tokens. (A draft that waits for the policy's first ask is told at its catch-up, in
    both: tests/test_batch_options.py.)"""
    temp = 0.7
    from test_prompt_look import decode

    from mlx_spec.policy import AdaptivePolicy

    target, draft = pair
    looked(monkeypatch)
    told = []
    original = AdaptivePolicy.observe_catch_up

    def record(self, source, tokens, seconds):
        told.append((source, tokens, seconds > 0))
        return original(self, source, tokens, seconds)
    monkeypatch.setattr(AdaptivePolicy, "observe_catch_up", record)
    prompt = prompt_of(40, seed=5)
    decode(target, draft, prompt, temp=temp, max_tokens=12)
    call, told[:] = list(told), []
    run(target, draft, [prompt], temp=temp, prompt_lookup=False)
    assert call and told == call


def test_a_row_alone_s_prefill_time_leaves_the_look_s_rows_out(monkeypatch):
    """The target's prefill time (v's prior) is its caches' alone, as a call's: the hidden
    states the look keeps (the last layer and the final norm over its rows, which no cache
    needs) are evaluated after it is taken. Here the final norm is made dear (a chain of
    matrix products, lazily): the time the row alone's policy is told leaves it out."""
    import time

    import mlx.nn as nn
    from tiny import make_llama, perturbed

    from mlx_spec.policy import AdaptivePolicy

    class DearNorm(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm
            self.big = mx.random.normal((384, 384), key=mx.random.key(0)) / 20

        def __call__(self, x):
            y = self.big
            for _ in range(12):
                y = y @ self.big
            return self.norm(x) + 0 * y.sum()

    target = make_llama(seed=0)
    draft = perturbed(target, noise=0.3, seed=2)
    target.model.norm = DearNorm(target.model.norm)
    looked(monkeypatch)
    told = []
    original = AdaptivePolicy.observe_prefill

    def record(self, tokens, seconds):
        told.append(seconds)
        return original(self, tokens, seconds)
    monkeypatch.setattr(AdaptivePolicy, "observe_prefill", record)
    started = time.perf_counter()
    mx.eval(target.model.norm(mx.zeros((1, 4, 48))))
    dear = time.perf_counter() - started
    run(target, draft, [prompt_of(40)], prompt_lookup=False)
    assert len(told) == 1 and told[0] < dear / 2, (told, dear)


@pytest.mark.parametrize("case", ["greedy", "pinned", "seeded", "short"])
def test_no_look_where_a_call_takes_none(pair, monkeypatch, case):  # noqa: F811
    """Greedy (the prompt is no guide), a pinned k or a seeded sampled row (pinned to the
    default k: no policy chooses), a prompt shorter than prompt_look.MIN_ROWS + 1: no look."""
    target, draft = pair
    seen = looked(monkeypatch)
    options = {"greedy": dict(temp=0.0), "pinned": dict(num_draft_tokens=2),
               "seeded": dict(seed=3)}.get(case, {})
    run(target, draft, [prompt_of(3 if case == "short" else 40)], **options)
    assert seen == []


def test_a_later_request_s_look_counts_after_its_first_round(pair, monkeypatch):  # noqa: F811
    """The engine's second request: its policy knows the machine from the first, so its first
    round may draft at once; the look after that round still takes the guessed prior's place
    (it was ignored while the draft had a round), and the first token did not wait for it."""
    from mlx_spec.batch.drafts import BatchDraft
    from mlx_spec.policy import AdaptivePolicy

    target, draft = pair
    looked(monkeypatch)
    at = []
    original = AdaptivePolicy.observe_prompt_look

    def record(self, source, acceptance, rows, **options):
        at.append(self.source(source).rounds)
        return original(self, source, acceptance, rows, **options)
    monkeypatch.setattr(AdaptivePolicy, "observe_prompt_look", record)
    # a draft step timed as free and no prefill time for v's prior (which on this CPU tells
    # the policy a verified token costs about a plain step): the second request drafts in
    # its first round
    monkeypatch.setattr(BatchDraft, "step_seconds", lambda self, row: 1e-6)
    monkeypatch.setattr(AdaptivePolicy, "observe_prefill", lambda self, tokens, seconds: None)
    engine = BatchEngine(target, draft)
    for seed in (0, 1):
        engine.insert(RowRequest(prompt_of(40, seed=seed), 8, SamplingConfig(temp=0.7)))
        first = engine.step()
        assert first and first[0].tokens and len(at) == seed  # the look after the first round
        while engine.busy:
            engine.step()
        assert len(at) == seed + 1 and engine.single.source("draft").looked
    assert at[1] >= 1  # (the second request drafted before its look: the case this checks)


@pytest.mark.parametrize("family,bits", [("gemma3_text", None), ("qwen3_5", None),
                                         ("gemma3_text", 4)],
                         ids=["sliding-window", "hybrid-recurrent", "quantized"])
def test_the_look_on_other_targets_equals_its_chances(monkeypatch, family, bits):
    """Sliding-window, Gated DeltaNet hybrid and 4-bit quantized targets (tiny, random) with a
    tiny draft: the look of a row alone is the same computation as above."""
    from families import shared_family
    from tiny import make_llama

    target = shared_family(family, quantize_bits=bits)
    draft = make_llama(vocab_size=64, seed=5, hidden=32, layers=1)
    prompt = prompt_of(40, seed=2)
    seen = looked(monkeypatch)
    run(target, draft, [prompt])
    assert [(s, r) for s, _, r in seen] == [("draft", prompt_look.ROWS)]
    x = mx.array([prompt[:-1]])
    expected = numpy_chances(target(x)[0, -prompt_look.ROWS:], draft(x)[0, -prompt_look.ROWS:],
                             0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
