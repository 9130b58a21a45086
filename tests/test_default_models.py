"""The shipped default pair and the target's trained MTP head: present, loadable offline,
exact (greedy parity, chi-square with its negative control), and usable with no flags."""

import json

import pytest
from click.testing import CliRunner

from mlx_spec import generate, load_default_pair
from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.cli import main
from mlx_spec.default_models import DEFAULT_DRAFT_PATH, DEFAULT_MTP_PATH, DEFAULT_TARGET_PATH
from mlx_spec.exactness import check_exactness
from mlx_spec.generate import speculative_generate_step
from mlx_spec.memory import model_bytes
from mlx_spec.sampling import SamplingConfig


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


# --- the target's trained MTP head -------------------------------------------------------

def test_mtp_head_fits_the_draft_budget():
    config = json.loads((DEFAULT_MTP_PATH / "mtp_config.json").read_text())
    assert config["model_type"] == "llama" and config["mtp_layout"] == "deepseek"
    head_bytes = (DEFAULT_MTP_PATH / "model.safetensors").stat().st_size
    assert head_bytes <= (DEFAULT_DRAFT_PATH / "model.safetensors").stat().st_size


@pytest.fixture(scope="module")
def plain_fibonacci(pair):
    """The target's own 48 tokens after "def fibonacci(n):" (its ids, and the tokens)."""
    target_model, _, tokenizer = pair
    prompt = tokenizer.encode("def fibonacci(n):")
    return prompt, [t for r in speculative_generate_step(prompt, target_model, max_tokens=48)
                    for t in r.tokens]


@pytest.mark.parametrize("k,lookup", [(1, False), (2, False), (4, False), (3, True)])
def test_greedy_parity_with_the_mtp_head(pair, plain_fibonacci, k, lookup):
    """draft_model="mtp" finds the shipped head with no argument; output is the target's own."""
    target_model = pair[0]
    prompt, plain = plain_fibonacci
    rounds = list(speculative_generate_step(prompt, target_model, "mtp", max_tokens=48,
                                            num_draft_tokens=k, prompt_lookup=lookup,
                                            calibration=None))
    assert [t for r in rounds for t in r.tokens] == plain
    assert sum(r.num_accepted for r in rounds if r.source == "mtp") > 0  # the head drafts well


MTP_EXACTNESS_PROMPT = "import os\n\n\ndef "
MTP_EXACTNESS_SAMPLES = 250  # the negative control fails at p ~ 1e-5, the exact rule passes


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)])
def test_exact_sampling_with_the_mtp_head(pair, accept, exact):
    """Chi-square of the first two tokens at T = 1 with the trained head drafting; resampling
    rejections from p instead of p - q (the negative control) must fail it."""
    target_model, _, tokenizer = pair
    prompt = tokenizer.encode(MTP_EXACTNESS_PROMPT)
    result = check_exactness(target_model, "mtp", prompt, SamplingConfig(temp=1.0),
                             samples=MTP_EXACTNESS_SAMPLES, num_draft_tokens=2, alpha=1e-3,
                             seed=0, accept=accept)
    assert 0.1 < result.acceptance_rate < 0.9, result  # the head is right often, not always
    assert result.passed == exact, result


def test_cli_generate_with_the_mtp_head():
    def run(*args):
        return CliRunner().invoke(main, ["generate", "--max-tokens", "24", *args])
    plain, mtp = run("--no-draft", "-q"), run("--mtp")
    assert plain.exit_code == 0 and mtp.exit_code == 0, (plain.output, mtp.output)
    assert plain.stdout.strip()  # there is text to compare (it starts with a blank line)
    assert mtp.stdout == plain.stdout  # all 24 greedy tokens, not just the first line
    assert "Speculation:" in mtp.stderr


@pytest.mark.parametrize("args,says", [
    # a llama with no MTP weights: the family has none, and the options are named
    (["-m", str(DEFAULT_DRAFT_PATH), "--mtp"],
     "this target is a llama; draft with a draft model or prompt lookup, or pass mtp_weights="),
    # the target's head on a model of another shape
    (["-m", str(DEFAULT_DRAFT_PATH), "--mtp", "--mtp-weights", str(DEFAULT_MTP_PATH)],
     "do not fit this target: enorm.weight has shape (256,) where the target's MTP layer needs (96,)"),
])
def test_cli_bad_mtp_input_is_one_sentence(args, says):
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "4", *args])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())


def test_cli_missing_mtp_weights_is_one_sentence(tmp_path):
    (tmp_path / "mtp_config.json").write_text((DEFAULT_MTP_PATH / "mtp_config.json").read_text())
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "4", "--mtp",
                                       "--mtp-weights", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"No MTP weights were found in {tmp_path}" in " ".join(result.output.split())
