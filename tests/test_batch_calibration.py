"""A calibration (`mlx-spec tune`) in the batch: each request starts where a call starts.

A call reads the machine's calibration for its own sampling (assemble.cost_prior): the cost
lines' prior points and the draft's measured acceptance at its temperature. The batch engine
(`batch_generate`, the batched server) reads the same: a request alone gets the call's policy
set-up, the calibration included; a row beside others starts its acceptance from the
calibration's at its temperature, not from the guess; a calibrated request takes no prompt
look (a call takes none: its prior is measured).
"""

import time

import pytest
from tiny import make_llama, perturbed

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.batch.api import batch_generate
from mlx_spec.calibration import Calibration, DraftCost, calibration_key, model_fingerprint
from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import DEFAULT_ACCEPTANCE_PRIOR, SAMPLING_ACCEPTANCE_PRIOR
from mlx_spec.precision import prepare_drafter
from mlx_spec.sampling import SamplingConfig

GREEDY_MEASURED, SAMPLED_MEASURED = 0.9, 0.3  # the made-up calibration's (T = 0, T = 1)


@pytest.fixture(scope="module")
def calibrated():
    """A target, its draft (prepared as drafting runs it: the calibration's fingerprint is of
    that) and a made-up calibration of the pair on this machine."""
    target = make_llama(seed=0)
    draft = perturbed(target, noise=0.3, seed=2)
    prepare_drafter(draft, target)
    cost = DraftCost(0.002, GREEDY_MEASURED, SAMPLED_MEASURED)
    calibration = Calibration(calibration_key(target), time.time(), 0.01, {1: 0.01, 8: 0.02},
                              {model_fingerprint(draft): cost})
    return target, draft, calibration


def engine_with(target, draft, calibration, temps, **engine):
    batch = BatchEngine(target, draft, calibration=calibration, **engine)
    rows = [batch.insert(RowRequest(list(range(3, 40)), 6, SamplingConfig(temp=t)))
            for t in temps]
    return batch, rows


@pytest.mark.parametrize("calibration_on", [True, False])
def test_a_row_beside_others_starts_from_the_calibration_s_acceptance(calibrated,
                                                                    calibration_on):
    target, draft, calibration = calibrated
    batch, _ = engine_with(target, draft, calibration if calibration_on else None,
                           [0.0, 1.0, 0.5])
    starts = [j.row.acceptance.acceptance for j in batch.joining]
    if calibration_on:  # between T = 0 and T = 1, the straight line (DraftCost.acceptance_at)
        expected = [GREEDY_MEASURED, SAMPLED_MEASURED, (GREEDY_MEASURED + SAMPLED_MEASURED) / 2]
    else:
        expected = [DEFAULT_ACCEPTANCE_PRIOR, SAMPLING_ACCEPTANCE_PRIOR, SAMPLING_ACCEPTANCE_PRIOR]
    assert starts == pytest.approx(expected)


@pytest.mark.parametrize("temp", [0.0, 0.7])
def test_a_row_alone_gets_the_policy_a_call_gets(calibrated, temp):
    """The same calibration, the same request: the batch's policy of a row alone and the
    loop's policy of a call start from the same prior (the calibration's, at this T)."""
    target, draft, calibration = calibrated
    batch, _ = engine_with(target, draft, calibration, [temp])
    batch.step()
    single = batch.single
    stream = speculative_generate_step(list(range(3, 40)), target, draft, max_tokens=6,
                                       sampling=SamplingConfig(temp=temp),
                                       calibration=calibration)
    next(stream)
    call = stream.policy
    assert single.describe()["calibrated"] and call.describe()["calibrated"]
    assert single.prior.acceptance == call.prior.acceptance
    assert single.prior.plain_seconds == call.prior.plain_seconds
    assert single.source("draft").prior == pytest.approx(
        GREEDY_MEASURED if temp == 0 else 0.7 * SAMPLED_MEASURED + 0.3 * GREEDY_MEASURED)
    stream.close()


def test_no_calibration_and_no_look_where_a_call_takes_none(calibrated):
    """calibration=None: no prior (a call given None starts cold); a calibrated sampled row
    keeps no hidden states for a prompt look, an uncalibrated one does."""
    target, draft, calibration = calibrated
    batch, _ = engine_with(target, draft, None, [0.7])
    batch.step()
    assert batch.single.prior is None and batch.rows[0].look_tail is not None
    batch, _ = engine_with(target, draft, calibration, [0.7])
    batch.step()
    assert batch.single.prior is not None and batch.rows[0].look_tail is None


def test_batch_generate_takes_a_calibration_and_keeps_its_answer(model_dirs):
    """Greedy answers do not depend on the calibration (only the policy reads it), and a
    wrong type is one sentence."""
    from mlx_spec import load

    target, tokenizer = load(str(model_dirs["target"]))
    draft = perturbed(target, noise=0.05, seed=1)
    calibration = Calibration(calibration_key(target), time.time(), 0.01, {1: 0.01, 8: 0.02}, {})
    prompts = ["def add(a, b):", "class Stack:"]
    answers = [batch_generate(target, tokenizer, prompts, draft_model=draft, max_tokens=10,
                              calibration=c).token_ids for c in (None, calibration)]
    assert answers[0] == answers[1]
    with pytest.raises(ValueError, match="calibration"):
        batch_generate(target, tokenizer, prompts, draft_model=draft, calibration=3)


def test_a_draft_of_another_tokenizer_starts_from_its_calibration_too(model_dirs):
    """`mlx-spec tune` measures a draft of another tokenizer too (its acceptance across the
    vocabularies); its rows start from it, as a call does."""
    from mlx_spec import load

    target, tokenizer = load(str(model_dirs["target"]))
    foreign, foreign_tokenizer = load(str(model_dirs["foreign"]))
    prepare_drafter(foreign, target)
    cost = DraftCost(0.002, GREEDY_MEASURED, SAMPLED_MEASURED)
    calibration = Calibration(calibration_key(target), time.time(), 0.01, {1: 0.01, 8: 0.02},
                              {model_fingerprint(foreign): cost})
    batch = BatchEngine(target, foreign, tokenizer=tokenizer, draft_tokenizer=foreign_tokenizer,
                        calibration=calibration)
    assert batch.cross is not None
    batch.insert(RowRequest(tokenizer.encode("def add(a, b):"), 4))
    assert batch.joining[0].row.acceptance.acceptance == pytest.approx(GREEDY_MEASURED)
