"""The mlx-lm-shaped Python API: load, stream_generate, generate, errors."""

import pytest

import mlx_spec
from mlx_spec import generate, load, stream_generate


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


def test_stream_generate_counts_and_flags(pair):
    target_model, draft_model, tokenizer = pair
    responses = list(stream_generate(target_model, tokenizer, "def f(x):",
                                     draft_model=draft_model, max_tokens=23,
                                     num_draft_tokens=3))
    last = responses[-1]
    assert last.finish_reason in ("length", "stop")
    assert all(r.finish_reason is None for r in responses[:-1])
    if last.finish_reason == "length":
        assert len(responses) == 23 and last.generation_tokens == 23
    stats = last.stats
    assert stats.accepted == sum(r.from_draft for r in responses) or last.finish_reason == "stop"
    assert sum(stats.accepted_histogram) == stats.rounds
    assert 0.0 <= stats.acceptance_rate <= 1.0


def test_generate_equals_plain_greedy(pair):
    target_model, draft_model, tokenizer = pair
    plain = generate(target_model, tokenizer, "def f(x):", max_tokens=30)
    spec = generate(target_model, tokenizer, "def f(x):", draft_model=draft_model,
                    max_tokens=30, num_draft_tokens=4)
    assert plain == spec


def test_generate_matches_mlx_lm_greedy(pair):
    import mlx_lm

    target_model, _, tokenizer = pair
    want = mlx_lm.generate(target_model, tokenizer, "def f(x):", max_tokens=20)
    got = generate(target_model, tokenizer, "def f(x):", max_tokens=20)
    assert got == want


def test_seeded_sampling_is_reproducible(pair):
    target_model, draft_model, tokenizer = pair
    runs = [generate(target_model, tokenizer, "x = ", draft_model=draft_model,
                     max_tokens=20, temp=1.0, seed=3) for _ in range(2)]
    assert runs[0] == runs[1]


def test_token_id_prompt(pair):
    target_model, _, tokenizer = pair
    ids = tokenizer.encode("def f(x):")
    assert generate(target_model, tokenizer, ids, max_tokens=8) == \
        generate(target_model, tokenizer, "def f(x):", max_tokens=8)


@pytest.mark.parametrize("kwargs,message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"temp": -0.5}, "temp"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_arguments_raise_value_error(pair, kwargs, message):
    target_model, draft_model, tokenizer = pair
    call = {"prompt": "def f(x):", "draft_model": draft_model, **kwargs}
    with pytest.raises(ValueError, match=message):
        list(stream_generate(target_model, tokenizer, **call))


def test_mismatched_vocabulary_raises(pair, model_dirs):
    target_model, _, tokenizer = pair
    foreign, foreign_tokenizer = load(str(model_dirs["foreign"]))
    with pytest.raises(ValueError, match="vocabular"):
        mlx_spec.check_pair(target_model, foreign, tokenizer, foreign_tokenizer)
    with pytest.raises(ValueError, match="vocabular"):
        list(stream_generate(target_model, tokenizer, "x", draft_model=foreign))


def test_missing_model_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load(str(tmp_path / "nope"))
