"""The real GGUF models (`make real-models`): loaded, answering, exact with speculation.

Skipped when the files are absent. Kept short: these models decode at about
10 tokens a second on a 2-core CPU.
"""

from __future__ import annotations

import pytest

from gguf_files import real_model_path

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"

pytestmark = pytest.mark.real_model


def _path(name):
    path = real_model_path(name)
    if path is None:
        pytest.skip(f"{name} is not downloaded (make real-models)")
    return path


@pytest.fixture(scope="module")
def smollm2():
    from mlx_spec import load

    return load(str(_path(SMOLLM2)))


@pytest.fixture(scope="module")
def gemma3():
    from mlx_spec import load

    return load(str(_path(GEMMA3)))


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


def test_smollm2_answers_a_chat_prompt(smollm2):
    from mlx_spec import generate

    model, tokenizer = smollm2
    text = generate(model, tokenizer, _chat(tokenizer, "What is the capital of France?"),
                    max_tokens=12)
    assert "Paris" in text


@pytest.mark.parametrize("name, bar, tokens", [(SMOLLM2, 0.01, 64), (GEMMA3, 0.03, 32)])
def test_perplexity_within_the_bar_of_an_independent_dequantization(name, bar, tokens):
    """mlx-spec's reading against every matrix dequantized by the gguf package (float32), on the
    passage's first tokens (bench.studies.gguf_fidelity scores it whole; Gemma's 262,144-row
    output layer makes its tokens dear on a CPU: 32, ppl 78.9 against 78.9)."""
    from bench.studies.gguf_fidelity import PASSAGE, _perplexity_and_logprobs
    from mlx_spec import load

    model, tokenizer = load(str(_path(name)))
    reference, _ = load(str(_path(name)), dequantize=True, dtype="float32")
    ids = tokenizer.encode(PASSAGE)[:tokens]
    ppl, _ = _perplexity_and_logprobs(model, ids)
    ref_ppl, _ = _perplexity_and_logprobs(reference, ids)
    assert abs(ppl / ref_ppl - 1) < bar
    assert ref_ppl < 100  # a model read wrongly (norms, Q/K layout) scores in the thousands


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_lookup_keeps_the_greedy_text(which, request):
    """Prompt lookup on a real target (Gemma: sliding-window caches) gives plain greedy text."""
    from mlx_spec import generate

    model, tokenizer = request.getfixturevalue(which)
    passage = "The keeper wrote the wind, the swell and the ships in a leather book every night."
    prompt = f"Copy this sentence exactly: {passage}\nCopy: The keeper wrote"
    plain = generate(model, tokenizer, prompt, max_tokens=12, prompt_lookup=False)
    drafted = generate(model, tokenizer, prompt, max_tokens=12, prompt_lookup=True)
    assert drafted == plain


def test_cli_generates_from_a_gguf_file():
    from click.testing import CliRunner

    from mlx_spec.cli import main

    result = CliRunner().invoke(main, ["generate", "--model", str(_path(SMOLLM2)), "--prompt",
                                       "What is the capital of France?", "--max-tokens", "10"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output and "Q4_1 kept" in result.output


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_rows_of_other_lengths_in_a_batch_keep_their_greedy_text(which, request):
    """Three prompts of other lengths decoding together (left padding; Gemma's sliding
    windows kept whole, applied by the mask), prompt lookup drafting: each row's text is the
    one a call alone gives."""
    from mlx_spec import batch_generate, stream_generate

    model, tokenizer = request.getfixturevalue(which)
    prompts = ["The sea", "Name three colours: red,",
               "Copy: the keeper wrote the wind in his book. Copy: the keeper wrote"]
    result = batch_generate(model, tokenizer, prompts, max_tokens=10)
    assert result.token_ids == [[r.token for r in stream_generate(
        model, tokenizer, p, max_tokens=10, prompt_lookup=False)] for p in prompts]
