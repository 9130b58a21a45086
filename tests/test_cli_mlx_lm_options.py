"""`mlx-spec generate` takes mlx-lm's generate options: --prefill-response (the answer begun in
the chat template), --extra-eos-token, --min-tokens-to-keep and XTC sampling (mlx-lm's sampler,
whose draws decide acceptance), --max-kv-size and --prefill-step-size; each gives the text
the Python API gives with the same arguments.
"""

import pytest
from click.testing import CliRunner
from mlx_lm.sample_utils import make_sampler
from tiny import write_model_dir

from mlx_spec import generate, load, load_default_pair, stream_generate
from mlx_spec.cli import main

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if not loop.last %}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}\n<assistant>{% endif %}")


def cli(*args):
    result = CliRunner().invoke(main, ["generate", "-q", *args])
    assert result.exit_code == 0, result.output
    return result.stdout[:-1]  # (the line's end after the text)


def test_prefill_response_begins_the_answer(tmp_path):
    path = write_model_dir(tmp_path / "m", chat_template=TEMPLATE)
    target, tokenizer = load(str(path))
    messages = [{"role": "user", "content": "def f"}, {"role": "assistant", "content": "x ="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert prompt.endswith("<assistant>x =")
    expected = generate(target, tokenizer, prompt, max_tokens=12)
    assert cli("-m", str(path), "--no-draft", "-n", "12", "--prompt", "def f",
               "--prefill-response", "x =") == expected


def test_an_extra_eos_token_ends_the_answer():
    target, _, tokenizer = load_default_pair()
    ids = [r.token for r in stream_generate(target, tokenizer, "def fibonacci(n):",
                                            max_tokens=30)]
    stop = ids[6]
    cut = ids[:ids.index(stop)]
    text = cli("-n", "30", "--ignore-chat-template", "--extra-eos-token",
               tokenizer.convert_ids_to_tokens(stop))
    assert text == tokenizer.decode(cut)
    assert len(cut) < 30
    bad = CliRunner().invoke(main, ["generate", "-n", "4", "--extra-eos-token", "zzqq-nothing"])
    assert bad.exit_code == 2 and "is not a token of this tokenizer" in bad.output


def test_xtc_and_min_tokens_to_keep_are_mlx_lms_sampler():
    target, draft, tokenizer = load_default_pair()
    sampler = make_sampler(0.9, 1.0, 0.05, 3, top_k=0, xtc_probability=0.5, xtc_threshold=0.1,
                           xtc_special_tokens=tokenizer.encode("\n")
                           + list(tokenizer.eos_token_ids))
    expected = generate(target, tokenizer, "def fibonacci(n):", draft_model=draft,
                        max_tokens=24, sampler=sampler, seed=3, calibration=None)
    assert cli("-n", "24", "--ignore-chat-template", "--temp", "0.9", "--min-p", "0.05",
               "--min-tokens-to-keep", "3", "--xtc-probability", "0.5", "--xtc-threshold", "0.1",
               "--seed", "3", "--no-calibration") == expected


@pytest.mark.parametrize("args,kwargs", [(("--max-kv-size", "12"), {"max_kv_size": 12}),
                                         (("--prefill-step-size", "3"), {"prefill_step_size": 3})])
def test_cache_and_prefill_options_reach_the_api(args, kwargs, monkeypatch):
    import importlib

    module = importlib.import_module("mlx_spec.generate")  # (the package's `generate` is a function)
    seen, real = [], module.stream_generate

    def spy(*a, **given):
        seen.append(given)
        return real(*a, **given)
    monkeypatch.setattr(module, "stream_generate", spy)
    target, draft, tokenizer = load_default_pair()
    expected = generate(target, tokenizer, "import os\n\n\ndef main():\n", draft_model=draft,
                        max_tokens=30, **kwargs)
    assert cli("-n", "30", "--ignore-chat-template", "--prompt", "import os\n\n\ndef main():\n",
               *args) == expected
    assert all(seen[-1][name] == value for name, value in kwargs.items())


def test_trust_remote_code_reaches_mlx_lms_loader(monkeypatch):
    """--trust-remote-code goes to mlx_lm.load for both models (as mlx-lm's flag does)."""
    import mlx_lm

    seen, real = [], mlx_lm.load

    def spy(path, **kwargs):
        seen.append(kwargs.get("trust_remote_code", False))
        return real(path, **kwargs)
    monkeypatch.setattr(mlx_lm, "load", spy)
    cli("-n", "4", "--trust-remote-code")
    assert seen == [True, True]  # the target and the shipped draft
    seen.clear()
    cli("-n", "4")
    assert seen == [False, False]


def test_escapes_in_the_prompt_are_read_as_mlx_lms_generate_reads_them():
    """`--prompt 'a\\nb'` (a backslash and an n, as a shell passes them) is a newline."""
    target, draft, tokenizer = load_default_pair()
    expected = generate(target, tokenizer, "def f(x):\n\treturn", draft_model=draft,
                        max_tokens=12)
    assert cli("-n", "12", "--ignore-chat-template", "--prompt", "def f(x):\\n\\treturn") == \
        expected
