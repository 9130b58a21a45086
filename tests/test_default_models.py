"""The shipped default pair: present, loadable offline, exact, and usable with no flags."""

import json

import pytest
from click.testing import CliRunner

from mlx_spec import generate, load_default_pair
from mlx_spec.cli import main
from mlx_spec.default_models import DEFAULT_DRAFT_PATH, DEFAULT_TARGET_PATH
from mlx_spec.memory import model_bytes


@pytest.fixture(scope="module")
def pair():
    return load_default_pair()


def test_files_in_hugging_face_layout():
    for path in (DEFAULT_TARGET_PATH, DEFAULT_DRAFT_PATH):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (path / name).exists(), f"{path / name} missing"
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == "llama"
    # the draft ties its embeddings (depth for the same bytes); the target does not
    assert json.loads((DEFAULT_TARGET_PATH / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((DEFAULT_DRAFT_PATH / "config.json").read_text())["tie_word_embeddings"] is True


def test_draft_is_at_most_an_eighth_of_the_target(pair):
    target_model, draft_model, _ = pair
    assert model_bytes(draft_model) * 8 <= model_bytes(target_model)


def test_greedy_parity_on_the_default_pair(pair):
    target_model, draft_model, tokenizer = pair
    prompt = "def fibonacci(n):"
    plain = generate(target_model, tokenizer, prompt, max_tokens=48)
    for k in (2, 5):
        for lookup in (False, True):  # the draft model alone, and behind prompt lookup
            spec = generate(target_model, tokenizer, prompt, draft_model=draft_model,
                            max_tokens=48, num_draft_tokens=k, prompt_lookup=lookup)
            assert spec == plain


def test_target_writes_python(pair):
    target_model, _, tokenizer = pair
    text = generate(target_model, tokenizer, "def fibonacci(n):", max_tokens=60)
    assert "\n    " in text  # indented body
    bodies = [generate(target_model, tokenizer, header, max_tokens=60)
              for header in ("def is_prime(n):", "def add(a, b):", "class Stack:")]
    assert all("\n    " in body for body in bodies)
    assert sum("return" in body for body in bodies) >= 2


def test_cli_runs_with_no_model_flags():
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "24"])
    assert result.exit_code == 0, result.output
    assert "Speculation:" in result.stderr
    assert result.stdout.strip()
