"""mlx-lm's batch_generate returns: `return_logprobs` (the target's log-probability of each
token, as a row alone's stream gives it) and `return_prompt_caches` (each row's cache at its
end, holding its prompt and output: a next turn on it is the text of the whole conversation
decoded at once); mlx-lm's `prompt_caches` input is one sentence.
"""

import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec import batch_generate, load_default_pair, stream_generate

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n\n\ndef"]


@pytest.fixture(scope="module")
def pair():
    return load_default_pair()


def test_each_tokens_log_probability_is_a_row_alones(pair):
    target, draft, tokenizer = pair
    result = batch_generate(target, tokenizer, PROMPTS, draft_model=draft, max_tokens=16,
                            return_logprobs=True)
    assert result.caches is None
    for prompt, ids, logprobs in zip(PROMPTS, result.token_ids, result.logprobs):
        alone = list(stream_generate(target, tokenizer, prompt, max_tokens=16,
                                     prompt_lookup=False))
        assert ids == [r.token for r in alone] and len(logprobs) == len(ids)
        expected = [r.logprobs[r.token].item() for r in alone]
        assert logprobs == pytest.approx(expected, abs=1e-4)


def test_a_rows_stop_token_has_its_log_probability_too():
    """Rows that end on a stop token (a frequent one made an end-of-sequence token): each
    token's log-probability lines up with token_ids, the stop token's included."""
    target, draft, tokenizer = load_default_pair()  # (its own tokenizer: one EOS more)
    tokenizer.add_eos_token(tokenizer.convert_ids_to_tokens(tokenizer.encode("(")[0]))
    result = batch_generate(target, tokenizer, PROMPTS, draft_model=draft, max_tokens=40,
                            return_logprobs=True)
    assert "stop" in result.finish_reasons
    for prompt, ids, logprobs in zip(PROMPTS, result.token_ids, result.logprobs):
        alone = list(stream_generate(target, tokenizer, prompt, max_tokens=40,
                                     prompt_lookup=False))
        assert ids == [r.token for r in alone]
        assert logprobs == pytest.approx([r.logprobs[r.token].item() for r in alone], abs=1e-4)


def test_a_returned_cache_carries_the_next_turn(pair):
    target, draft, tokenizer = pair
    result = batch_generate(target, tokenizer, PROMPTS, draft_model=draft, max_tokens=12,
                            return_prompt_caches=True)
    assert result.logprobs is None and len(result.caches) == len(PROMPTS)
    more = tokenizer.encode("\n\n\ndef main():")
    for prompt, ids, cache in zip(PROMPTS, result.token_ids, result.caches):
        assert len(cache) == len(make_prompt_cache(target)) + len(make_prompt_cache(draft))
        nxt = [r.token for r in stream_generate(target, tokenizer, more, draft_model=draft,
                                                max_tokens=12, prompt_cache=cache)]
        whole = tokenizer.encode(prompt) + ids + more
        assert nxt == [r.token for r in stream_generate(target, tokenizer, whole,
                                                        max_tokens=12, prompt_lookup=False)]


def test_mlx_lms_prompt_caches_input_is_one_sentence(pair):
    target, draft, tokenizer = pair
    with pytest.raises(ValueError, match="batch_generate takes no prompt_caches"):
        batch_generate(target, tokenizer, PROMPTS[:1], max_tokens=4,
                       prompt_caches=[make_prompt_cache(target)])
