"""A policy object in the batch (issue 62: what only the loop took): `BatchEngine(policy=...)`
is asked for a row decoding alone, as a call's `policy=` is by the loop (the protocol:
proposal_length, plain_steps, observe, describe; AdaptivePolicy's other methods only where it
has them). The same scripted policy gives the same rounds (source, drafts, kept) through a
call and through a row alone; beside other rows the batch policy chooses."""

import pytest

from test_batch import pair, ragged_prompts  # noqa: F401 (fixtures)

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig


class Scripted:
    """k for each round from a script (then its last), a plain block of 3: what was asked."""

    def __init__(self, script=(1, 3, 0, 2, 4)):
        self.script, self.asked, self.observed = list(script), [], []

    def proposal_length(self, source):
        k = self.script[min(len(self.observed), len(self.script) - 1)]
        self.asked.append((source, k))
        return k

    def plain_steps(self):
        return 3

    def observe(self, round_, seconds):
        self.observed.append((round_.source, round_.num_drafted, round_.num_accepted,
                              len(round_.tokens)))

    def describe(self):
        return {"policy": "scripted"}


def rounds_of_a_row_alone(engine, request):
    outputs = []
    engine.insert(request)
    while engine.busy:
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_a_row_alone_asks_the_policy_object_as_a_call_does(pair, temp):  # noqa: F811
    target, draft = pair
    prompt = ragged_prompts(3)[2]
    sampling = SamplingConfig(temp=temp)
    in_call = Scripted()
    call = list(speculative_generate_step(prompt, target, draft, max_tokens=24,
                                          sampling=sampling, policy=in_call,
                                          prompt_lookup=False))
    in_batch = Scripted()
    engine = BatchEngine(target, draft, policy=in_batch)
    outputs = rounds_of_a_row_alone(engine, RowRequest(prompt, 24, sampling, prompt_lookup=False))
    assert sum(len(o.tokens) for o in outputs) == 24
    assert len(in_batch.asked) > 3 and len(in_batch.observed) == len(outputs)
    if temp == 0:  # the same text, each round drafting and keeping as many
        assert in_batch.asked == in_call.asked
        assert in_batch.observed == in_call.observed
        assert [t for o in outputs for t in o.tokens] == [t for r in call for t in r.tokens]
    else:  # (the two draw from other random streams: rounds keep other numbers of drafts)
        assert in_batch.asked[:4] == in_call.asked[:4]
        assert [o[1] for o in in_batch.observed[:4]] == [r[1] for r in in_call.observed[:4]]


def test_rows_beside_others_are_chosen_for_by_the_batch_policy(pair):  # noqa: F811
    target, draft = pair
    policy = Scripted()
    engine = BatchEngine(target, draft, policy=policy)
    for prompt in ragged_prompts(2):
        engine.insert(RowRequest(prompt, 6, prompt_lookup=False))
    while len(engine.rows) + len(engine.joining) == 2:
        engine.step()
    assert policy.asked == [] and policy.observed == []


def test_a_policy_object_and_a_pinned_k_are_one_sentence(pair):  # noqa: F811
    target, draft = pair
    with pytest.raises(ValueError, match="policy or num_draft_tokens"):
        BatchEngine(target, draft, policy=Scripted(), num_draft_tokens=2)
    with pytest.raises(ValueError, match="proposal_length"):
        BatchEngine(target, draft, policy=object())
