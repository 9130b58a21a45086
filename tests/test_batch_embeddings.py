"""input_embeddings in the batch (issue 62: what only the loop took): a row's target is fed
its embeddings in place of the prompt tokens' own, in chunks; its first token comes from the
last embedding as the row joins; its drafters read the prompt's ids. Each row's text is the
target's given those embeddings (mlx-lm's own decoding of the ids they embed), beside other
rows and alone, with a draft model and prompt lookup; what cannot work is one sentence."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from test_batch import pair, ragged_prompts  # noqa: F401 (fixtures)

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.sampling import SamplingConfig


def greedy(target, prompt, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=max_tokens,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


def embedded(target, ids):
    """(len(ids), H): the target's own embeddings of `ids`."""
    return target.model.embed_tokens(mx.array(ids))


def decode(engine, requests):
    """Every row's tokens and outputs, in request order."""
    uids = [engine.insert(r) for r in requests]
    tokens, outputs = {u: [] for u in uids}, {u: [] for u in uids}
    while engine.busy:
        for out in engine.step():
            tokens[out.uid] += out.tokens
            outputs[out.uid].append(out)
    return [tokens[u] for u in uids], [outputs[u] for u in uids]


@pytest.mark.parametrize("k", [None, 2])
def test_rows_fed_embeddings_follow_them_beside_other_rows(pair, k):  # noqa: F811
    """Rows whose embeddings are another prompt's (the reversed ids: the output follows the
    embeddings, not the ids), one prefilled in chunks of 2, beside plain rows: each row's text
    is the target's own for what it was fed."""
    target, draft = pair
    prompts = ragged_prompts(4)
    other = [p[::-1] for p in prompts]
    engine = BatchEngine(target, draft, num_draft_tokens=k, prefill_step_size=2)
    requests = [RowRequest(p, 16, input_embeddings=embedded(target, o)) if i % 2 == 0
                else RowRequest(p, 16) for i, (p, o) in enumerate(zip(prompts, other))]
    got, _ = decode(engine, requests)
    for i, tokens in enumerate(got):
        assert tokens == greedy(target, other[i] if i % 2 == 0 else prompts[i], 16), i
    assert greedy(target, other[0], 16) != greedy(target, prompts[0], 16)


def test_a_row_alone_fed_its_own_embeddings_drafts_and_keeps_the_greedy_text(pair):  # noqa: F811
    """The ids' own embeddings: the draft model (it reads the ids, the prompt's last and the
    first token after the join) and lookup draft, drafts are kept, the text is the target's."""
    target, draft = pair
    prompt = ragged_prompts(3)[2] * 2  # (lookup has a match)
    engine = BatchEngine(target, draft, auto_off=False)
    [tokens], [outputs] = decode(engine, [RowRequest(prompt, 40,
                                                     input_embeddings=embedded(target, prompt))])
    assert tokens == greedy(target, prompt, 40)
    assert outputs[0].tokens == tokens[:1] and outputs[0].source == "target"
    assert sum(o.num_accepted for o in outputs if o.source == "draft") > 0


def test_a_first_token_that_ends_the_row_ends_it_at_the_join(pair):  # noqa: F811
    target, draft = pair
    prompt = ragged_prompts(1)[0]
    first = greedy(target, prompt, 1)
    engine = BatchEngine(target, draft)
    requests = [RowRequest(prompt, 1, input_embeddings=embedded(target, prompt)),
                RowRequest(prompt, 8, input_embeddings=embedded(target, prompt),
                           stop_tokens=first),
                RowRequest(prompt, 3)]
    got, outputs = decode(engine, requests)
    assert got[:2] == [first, first] and got[2] == greedy(target, prompt, 3)
    assert [o.finish_reason for o in outputs[0]] == ["length"]
    assert [o.finish_reason for o in outputs[1]] == ["stop"]
    assert not engine.rows and not engine.joining


def test_a_seeded_row_fed_embeddings_draws_its_own_stream_beside_others(pair):  # noqa: F811
    """T = 0.8 with a seed: the row's first token is drawn with its own key, as its rounds':
    its text is the same alone and beside other rows."""
    target, draft = pair
    prompts = ragged_prompts(3)
    sampling = SamplingConfig(temp=0.8)
    row = RowRequest(prompts[0], 12, sampling, seed=5,
                     input_embeddings=embedded(target, prompts[0][::-1]))
    alone, _ = decode(BatchEngine(target, draft), [row])
    beside, _ = decode(BatchEngine(target, draft), [RowRequest(prompts[1], 9, sampling), row,
                                                    RowRequest(prompts[2], 5, sampling)])
    assert alone[0] == beside[1] and len(alone[0]) == 12


def test_what_embeddings_cannot_do_is_one_sentence(pair, tmp_path):  # noqa: F811
    from test_mtp import make_target, mtp_params, write_original

    target, draft = pair
    prompt = ragged_prompts(1)[0]
    engine = BatchEngine(target, draft)
    with pytest.raises(ValueError, match="give as many ids[.]"):
        engine.insert(RowRequest(prompt, 4, input_embeddings=embedded(target, prompt[:-1])))
    with pytest.raises(ValueError, match="wide: the model's hidden size"):
        engine.insert(RowRequest(prompt, 4, input_embeddings=embedded(target, prompt)[:, :-1]))
    with pytest.raises(ValueError, match="shape"):
        engine.insert(RowRequest(prompt, 4, input_embeddings=embedded(target, prompt)[None]))
    with pytest.raises(ValueError, match="keep_cache"):
        engine.insert(RowRequest(prompt, 4, input_embeddings=embedded(target, prompt),
                                 keep_cache=True))
    mtp_target = make_target("qwen3_5")  # (it takes input_embeddings; deepseek_v3 does not)
    weights = write_original(tmp_path / "mtp", mtp_target, mtp_params(mtp_target))
    engine = BatchEngine(mtp_target, "mtp", mtp_weights=str(weights))
    with pytest.raises(ValueError, match="MTP head"):
        engine.insert(RowRequest([1, 2, 3], 4, input_embeddings=mtp_target.model.embed_tokens(
            mx.array([1, 2, 3]))))
    assert not engine.joining
    with pytest.raises(ValueError, match="wide: the model's hidden size"):  # (a call's too)
        from mlx_spec.generate import speculative_generate_step
        speculative_generate_step(prompt, target, max_tokens=2,
                                  input_embeddings=embedded(target, prompt)[:, :-1])


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text", "lfm2"])
def test_embedding_rows_on_recurrent_and_sliding_targets_follow_mlx_lm(name):
    """A Gated DeltaNet hybrid, sliding windows and a short-convolution hybrid, each drafted for
    by its own weights at 4 bits (rows keep different numbers of drafts, states go back): rows
    fed embeddings beside a plain row give mlx-lm's own greedy decoding of those embeddings."""
    from families import shared_family, shared_plain_greedy

    from mlx_spec.mtp.heads import text_model

    target = shared_family(name)
    draft = shared_family(name, quantize_bits=4)
    prompts = ragged_prompts(3)
    embed = text_model(target).model.embed_tokens
    fed = [embed(mx.array(p[::-1])) * 1.5 for p in prompts[:2]]  # (not the ids' own)
    requests = [RowRequest(p, 12, input_embeddings=e, prompt_lookup=False)
                for p, e in zip(prompts, fed)] + [RowRequest(prompts[2], 12)]
    got, _ = decode(BatchEngine(target, draft, num_draft_tokens=3), requests)
    for prompt, embeddings, tokens in zip(prompts, fed, got):
        assert tokens == [int(t) for t, _ in generate_step(
            mx.array(prompt), target, max_tokens=12, input_embeddings=embeddings,
            sampler=lambda lp: mx.argmax(lp, axis=-1))]
    assert got[2] == shared_plain_greedy(target, prompts[2], 12)
