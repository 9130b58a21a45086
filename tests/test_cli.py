"""`mlx-spec generate` end to end on tiny local model directories."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from mlx_spec.cli import main


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_generate_streams_text_and_stats(model_dirs):
    result = run("generate", "--model", str(model_dirs["target"]), "--draft-model",
                 str(model_dirs["draft"]), "--prompt", "def f(x):", "-n", "20", "-k", "3")
    assert result.exit_code == 0, result.output
    assert "Speculation:" in result.stderr and "Generation: " in result.stderr
    assert result.stdout.strip()


def test_greedy_output_identical_with_and_without_draft(model_dirs):
    common = ["generate", "--model", str(model_dirs["target"]), "-p", "def f(x):", "-n", "25", "-q"]
    plain = run(*common, "--no-draft")
    spec = run(*common, "--draft-model", str(model_dirs["draft"]))
    assert plain.exit_code == spec.exit_code == 0
    assert plain.stdout == spec.stdout


def test_prompt_from_stdin_and_prompt_lookup(model_dirs):
    result = run("generate", "--model", str(model_dirs["target"]), "--prompt", "-",
                 "--prompt-lookup", "-n", "10", input="def f(x):\n    return x\n")
    assert result.exit_code == 0, result.output


def test_color_marks_draft_tokens(model_dirs):
    # The target drafting for itself accepts every draft; k pinned, because under the default
    # policy a draft whose step costs a target step never drafts (it would lose with every draft kept).
    result = run("generate", "--model", str(model_dirs["target"]), "--draft-model",
                 str(model_dirs["target"]), "-n", "12", "--color", "-q", "--num-draft-tokens", "3")
    assert result.exit_code == 0
    assert "\x1b[32m" in result.stdout  # green: accepted from the draft


@pytest.mark.parametrize("args,fragment", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--prompt", ""], "prompt is empty"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p"),
])
def test_bad_input_is_one_clear_error(model_dirs, args, fragment):
    base = ["generate", "--model", str(model_dirs["target"])]
    result = run(*base, *args)
    assert result.exit_code != 0
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_console_script_exit_code(model_dirs):
    """The installed entry point itself: a real process and a real exit code."""
    proc = subprocess.run([sys.executable, "-m", "mlx_spec", "generate", "--model",
                           "/nonexistent/model"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Error:" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_template_applied_unless_ignored(model_dirs):
    common = ["generate", "--model", str(model_dirs["chat"]), "-p", "def f(x):", "-n", "15", "-q"]
    templated = run(*common)
    raw = run(*common, "--ignore-chat-template")
    same_weights_raw = run("generate", "--model", str(model_dirs["target"]), "-p", "def f(x):",
                           "-n", "15", "-q")
    assert templated.exit_code == raw.exit_code == 0
    assert raw.stdout == same_weights_raw.stdout  # identical weights, template skipped
    assert templated.stdout != raw.stdout


def test_check_command_reports_exactness(model_dirs):
    result = run("check", "--model", str(model_dirs["target"]), "--draft-model",
                 str(model_dirs["draft"]), "--samples", "200")
    assert result.exit_code == 0, result.output
    assert "indistinguishable from the target" in result.stdout


def test_check_needs_something_to_check(model_dirs):
    result = run("check", "--model", str(model_dirs["target"]), "--samples", "200")
    assert result.exit_code != 0 and "nothing to check" in result.output


def test_seeded_sampling_repeats_from_the_command_line(model_dirs):
    args = ["generate", "--model", str(model_dirs["target"]), "--draft-model",
            str(model_dirs["draft"]), "-n", "30", "--temp", "1.0", "--seed", "7", "-q"]
    first, second = run(*args), run(*args)
    assert first.exit_code == second.exit_code == 0
    assert first.stdout == second.stdout


def test_help_and_version_import_no_mlx():
    """Start-up: `--version` and `--help` answer without importing MLX, mlx-lm or the server's
    HTTP libraries."""
    code = ("import sys\n"
            "from mlx_spec.cli import main\n"
            "for args in (['--version'], ['--help'], ['generate', '--help'], ['check', '--help'],\n"
            "             ['bench', '--help'], ['serve', '--help']):\n"
            "    assert main(args, standalone_mode=False) in (None, 0)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in\n"
            "             ('mlx', 'mlx_lm', 'starlette', 'uvicorn')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_defaults_shown_by_the_cli_are_the_apis():
    """`--help` shows mlx_spec.defaults (no MLX import); the modules using them agree."""
    from mlx_spec import defaults, policy
    from mlx_spec.drafters import prompt_lookup
    from mlx_spec.generate import DEFAULT_MAX_TOKENS

    assert prompt_lookup.DEFAULT_MAX_NGRAM == defaults.DEFAULT_MAX_NGRAM
    assert policy.DEFAULT_NUM_DRAFT_TOKENS == defaults.DEFAULT_NUM_DRAFT_TOKENS
    assert DEFAULT_MAX_TOKENS == defaults.DEFAULT_MAX_TOKENS
