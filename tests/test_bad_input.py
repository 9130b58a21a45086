"""Every bad input gets one sentence: a ValueError naming the argument (API), or one
line and a non-zero exit (CLI). Tables of (input, the sentence expected); each row
asserts the words, not only the exception type. Ctrl-C at any moment: one line, 130."""

import importlib
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_spec import generate, load, stream_generate
from mlx_spec.cli import main
from mlx_spec.exactness import check_exactness
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

NAN = float("nan")


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


# ---- Python API -----------------------------------------------------------------

API_CASES = [
    # ints where ints are meant: not floats, not bools, not below the minimum
    ({"max_tokens": 0}, "max_tokens must be an int >= 1, or -1 for no limit, got 0."),
    ({"max_tokens": 2.5}, "max_tokens must be an int >= 1, or -1 for no limit, got 2.5."),
    ({"max_tokens": True}, "max_tokens must be an int >= 1, or -1 for no limit, got True."),
    ({"num_draft_tokens": 0}, "num_draft_tokens must be None or an int >= 1, got 0."),
    ({"num_draft_tokens": 2.5}, "num_draft_tokens must be None or an int >= 1, got 2.5."),
    ({"top_k": 2.5}, "top_k must be an int >= 0 (0 disables top-k), got 2.5."),
    ({"top_k": -1}, "top_k must be an int >= 0 (0 disables top-k), got -1."),
    ({"max_draft_tokens": 0}, "max_draft_tokens must be an int >= 1, got 0."),
    ({"max_draft_tokens": 1.5}, "max_draft_tokens must be an int >= 1, got 1.5."),
    ({"prefill_step_size": 0}, "prefill_step_size must be None or an int >= 1, got 0."),
    ({"prefill_step_size": 64.0}, "prefill_step_size must be None or an int >= 1, got 64.0."),
    ({"prompt_lookup_max_ngram": 0}, "prompt_lookup_max_ngram must be an int >= 1, got 0."),
    ({"prompt_lookup_max_ngram": 2.5}, "prompt_lookup_max_ngram must be an int >= 1, got 2.5."),
    # floats in range
    ({"temp": -0.5}, "temp must be a number >= 0 (0 is greedy), got -0.5."),
    ({"temp": NAN}, "temp must be a number >= 0 (0 is greedy), got nan."),
    ({"temp": "0.7"}, "temp must be a number >= 0 (0 is greedy), got '0.7'."),
    ({"top_p": 0.0}, "top_p must be a number in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5."),
    ({"min_p": 1.0}, "min_p must be a number in [0, 1), got 1.0."),
    ({"min_p": -0.1}, "min_p must be a number in [0, 1), got -0.1."),
    ({"draft_confidence": 1.0}, "draft_confidence must be a number in [0, 1), got 1.0."),
    ({"draft_confidence": -0.1}, "draft_confidence must be a number in [0, 1), got -0.1."),
    # seeds MLX accepts: an unsigned 64-bit int
    ({"seed": -1}, "seed must be None or an int in [0, 2**64) (MLX's seed range), got -1."),
    ({"seed": 2**64}, "seed must be None or an int in [0, 2**64) (MLX's seed range), got 18446744073709551616."),
    ({"seed": 1.5}, "seed must be None or an int in [0, 2**64) (MLX's seed range), got 1.5."),
    # flags and callbacks
    ({"adaptive": "yes"}, "adaptive must be True, False or None, got 'yes'."),
    ({"prompt_lookup": 1}, "prompt_lookup must be True, False or None, got 1."),
    ({"auto_off": None}, "auto_off must be True or False, got None."),
    ({"prompt_progress_callback": 5}, "prompt_progress_callback must be None or a function, got 5."),
    # prompts: text, a list of int token ids, or a 1-D integer array
    ({"prompt": mx.array([[1, 2, 3]])}, "prompt must be a string, a list of token ids (ints) or a "
                                        "1-D integer array, got an array of shape (1, 3); pass one sequence."),
    ({"prompt": mx.array([1.0, 2.0])}, "got an array of mlx.core.float32."),
    ({"prompt": mx.array([True, False])}, "got an array of mlx.core.bool."),
    ({"prompt": np.array([[1, 2]])}, "got an array of shape (1, 2); pass one sequence."),
    ({"prompt": [1, 2.5]}, "got a list holding 2.5."),
    ({"prompt": [True, False]}, "got a list holding True."),
    ({"prompt": [[1, 2]]}, "got a list holding a list."),
    ({"prompt": {"text": "x"}}, "got a dict."),
    ({"prompt": None}, "got None."),
    ({"prompt": ""}, "The prompt is empty"),
    ({"prompt": []}, "The prompt is empty"),
    ({"prompt": [1, 10**6]}, "prompt holds token id 1000000, outside the target model's vocabulary"),
    ({"prompt": [-2]}, "prompt holds token id -2, outside the target model's vocabulary"),
]


@pytest.mark.parametrize("kwargs,sentence", API_CASES, ids=[str(c[0])[:50] for c in API_CASES])
def test_stream_generate_names_the_bad_argument(pair, kwargs, sentence):
    target_model, draft_model, tokenizer = pair
    call = {"prompt": "def f(x):", "draft_model": draft_model, "max_tokens": 2, **kwargs}
    with pytest.raises(ValueError) as error:
        list(stream_generate(target_model, tokenizer, **call))
    assert sentence in str(error.value)


@pytest.mark.parametrize("case", ["swapped", "tokenizer", "draft", "verbose"])
def test_models_and_flags_of_generate_are_checked(pair, case):
    target_model, draft_model, tokenizer = pair
    call = {"swapped": lambda: generate(tokenizer, target_model, "x"),
            "tokenizer": lambda: generate(target_model, 5, "x"),
            "draft": lambda: generate(target_model, tokenizer, "x", draft_model=3),
            "verbose": lambda: generate(target_model, tokenizer, "x", verbose="yes")}[case]
    sentence = {"swapped": "model must be a model such as load() returns, got a TokenizerWrapper.",
                "tokenizer": "tokenizer must be a tokenizer such as load() returns, got 5.",
                "draft": "draft_model must be None, a model such as load() returns, a DFlash "
                         "drafter, an EAGLE-3 head, the path of one, or \"mtp\", got 3.",
                "verbose": "verbose must be True or False, got 'yes'."}[case]
    with pytest.raises(ValueError) as error:
        call()
    assert sentence in str(error.value)


STEP_CASES = [
    ({"prompt": mx.array([[1, 2]])}, "got an array of shape (1, 2)"),
    ({"prompt": "text"}, "speculative_generate_step takes token ids"),
    ({"sampling": "greedy"}, "sampling must be a SamplingConfig, got 'greedy'."),
    ({"max_tokens": 3.0}, "max_tokens must be an int >= 1, or -1 for no limit, got 3.0."),
    ({"num_draft_tokens": True}, "num_draft_tokens must be None or an int >= 1, got True."),
    ({"prefill_step_size": -4}, "prefill_step_size must be None or an int >= 1, got -4."),
]


@pytest.mark.parametrize("kwargs,sentence", STEP_CASES, ids=[str(c[0])[:40] for c in STEP_CASES])
def test_speculative_generate_step_names_the_bad_argument(pair, kwargs, sentence):
    target_model, draft_model, _ = pair
    call = {"prompt": [1, 2, 3], "max_tokens": 2, **kwargs}
    prompt = call.pop("prompt")
    with pytest.raises(ValueError) as error:
        list(speculative_generate_step(prompt, target_model, draft_model, **call))
    assert sentence in str(error.value)


def test_sampling_config_and_exactness_check_their_arguments(pair):
    target_model, draft_model, _ = pair
    with pytest.raises(ValueError, match=r"top_k must be an int >= 0 \(0 disables top-k\), got 2.5\."):
        SamplingConfig(temp=1.0, top_k=2.5)
    for kwargs, sentence in [({"seed": -1}, "seed must be None or an int in [0, 2**64)"),
                             ({"samples": 50}, "samples must be an int >= 100, got 50."),
                             ({"prompt": "text"}, "prompt must be token ids here")]:
        call = {"prompt": [1, 2, 3], "samples": 100, **kwargs}
        with pytest.raises(ValueError) as error:
            check_exactness(target_model, draft_model, call.pop("prompt"),
                            SamplingConfig(temp=1.0), **call)
        assert sentence in str(error.value)


@pytest.mark.parametrize("kwargs", [
    {"prompt": np.array([5, 6, 7])},
    {"prompt": (5, 6, 7)},
    {"prompt": mx.array([5, 6, 7], dtype=mx.uint32)},
    {"prompt": [np.int64(5), 6, 7]},
    {"top_k": np.int64(3), "temp": np.float32(0.5), "seed": 2**64 - 1},
    {"num_draft_tokens": np.int32(2), "seed": 0, "temp": 1},
])
def test_what_the_checks_accept(pair, kwargs):
    """The checks are not stricter than the API: numpy scalars and arrays, tuples, ints as floats."""
    target_model, draft_model, tokenizer = pair
    call = {"prompt": "def f(x):", "draft_model": draft_model, "max_tokens": 2, **kwargs}
    assert len(list(stream_generate(target_model, tokenizer, **call))) >= 1


# ---- Command line ---------------------------------------------------------------

SEED_RANGE = "is not in the range 0<=x<=18446744073709551615"
CLI_CASES = [
    (["generate", "--seed", "-1"], f"Invalid value for '--seed': -1 {SEED_RANGE}."),
    (["generate", "--seed", str(2**64)], f"Invalid value for '--seed': {2**64} {SEED_RANGE}."),
    (["check", "--seed", "-1"], f"Invalid value for '--seed': -1 {SEED_RANGE}."),
    (["bench", "--seed", "-1"], f"Invalid value for '--seed': -1 {SEED_RANGE}."),
    (["generate", "--top-k", "2.5"], "Invalid value for '--top-k': '2.5' is not a valid integer range."),
    (["generate", "--max-tokens", "2.5"], "Invalid value for '--max-tokens'"),
    (["generate", "--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["generate", "-k", "0"], "Invalid value for '--num-draft-tokens'"),
    (["generate", "--max-draft-tokens", "0"], "Invalid value for '--max-draft-tokens'"),
    (["generate", "--prompt-lookup-max-ngram", "0"], "Invalid value for '--prompt-lookup-max-ngram'"),
    (["generate", "--temp", "-1"], "Invalid value for '--temp'"),
    (["generate", "--temp", "nan"], "temp must be a number >= 0 (0 is greedy), got nan."),
    (["generate", "--top-p", "0"], "Invalid value for '--top-p'"),
    (["generate", "--min-p", "1"], "Invalid value for '--min-p'"),
    (["generate", "--draft-confidence", "1"], "Invalid value for '--draft-confidence'"),
    (["generate", "--prompt", ""], "The prompt is empty; pass --prompt TEXT"),
    (["generate", "--prompt", " \n "], "The prompt is empty; pass --prompt TEXT"),
    (["generate", "--model", "/nonexistent/model"], "Model path '/nonexistent/model' does not exist"),
    (["generate", "--model", "{target}/config.json"], "Cannot load the target model"),
    (["serve", "--model", "{target}", "--tree", "3"], "give auto, off or DEPTHxWIDTH"),
    (["check", "--samples", "50"], "Invalid value for '--samples'"),
    (["check", "--temp", "0"], "Invalid value for '--temp'"),
    (["check"], "Give --draft-model, --prompt-lookup or --suffix: there is nothing to check."),
    (["bench", "--max-tokens", "1"], "Invalid value for '--max-tokens'"),
    (["bench", "--target-sizes", "0x1"], "--target-sizes wants HIDDENxLAYERS pairs"),
    (["bench", "--json", "/proc/no/such/dir/b.json"], "Cannot write /proc/no/such/dir/b.json"),
    (["bench", "--rerender", "{target}/tokenizer_config.json"], "is not a bench result JSON"),
    (["--no-such-flag"], "No such option"),
]


@pytest.mark.parametrize("args,sentence", CLI_CASES, ids=[" ".join(c[0])[:50] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(model_dirs, args, sentence):
    paths = {name: str(path) for name, path in model_dirs.items()}
    args = [a.format(**paths) for a in args]
    if args[0] in ("generate", "check", "bench") and "--model" not in args:
        args += ["--model", paths["target"]]
    if args[0] == "bench" and "--draft-model" not in args:
        args += ["--draft-model", paths["draft"]]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)  # not an exception escaping from inside
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and sentence in errors[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("how", ["stdin", "argument", "lone surrogate"])
def test_undecodable_prompt_is_replaced_with_a_warning(model_dirs, how):
    """Bytes that are not UTF-8 become U+FFFD and one warning line; generation goes on."""
    args = ["generate", "--model", str(model_dirs["target"]), "-n", "3", "-q"]
    if how == "stdin":
        result = CliRunner().invoke(main, args + ["--prompt", "-"], input=b"def f(x):\xff\xfe\n")
    else:  # on Linux, argv bytes that are not UTF-8 arrive as surrogate escapes
        prompt = "def f(x): \udcff" if how == "argument" else "def f(x): \ud800"
        result = CliRunner().invoke(main, args + ["--prompt", prompt])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "Warning: the prompt is not valid UTF-8; undecodable bytes were replaced with U+FFFD."]
    assert result.stdout.strip()


INTERRUPT = textwrap.dedent("""
    import importlib, os, signal, sys, threading
    moment, argv = sys.argv[1], sys.argv[2:]
    interrupt = lambda: os.kill(os.getpid(), signal.SIGINT)
    if moment == "loading":
        loading = importlib.import_module("mlx_spec.loading")
        load = loading.load
        loading.load = lambda *a, **k: (interrupt(), load(*a, **k))[1]
    elif moment == "callback":  # inside a weakref callback, which Python cannot raise out of
        import weakref
        loading = importlib.import_module("mlx_spec.loading")
        load = loading.load
        class Dropped:
            pass
        def load_dropping(*a, **k):
            dropped = Dropped()
            ref = weakref.ref(dropped, lambda ref: (interrupt(), sum(range(100))))
            del dropped  # the callback runs here; the handler raises inside it
            return load(*a, **k)
        loading.load = load_dropping
    elif moment == "generating":
        api = importlib.import_module("mlx_spec.generate")
        stream = api.stream_generate
        def interrupted_stream(*a, **k):
            for i, response in enumerate(stream(*a, **k)):
                if i == 3:
                    interrupt()
                yield response
        api.stream_generate = interrupted_stream
    else:  # a moment in start-up: imports, reading the prompt from stdin
        threading.Timer(float(moment), interrupt).start()  # the handler is set within ms
    from mlx_spec.console import main
    sys.argv = ["mlx-spec", *argv]
    main()
""")


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(model_dirs):
    """Interrupted during imports, reading stdin, loading the model, in a weakref callback
    (where Python reports the exception as unraisable and goes on) and generating."""
    args = ["generate", "--model", str(model_dirs["target"]), "-n", "1000", "--prompt", "-"]
    moments = ["0.05", "1.0", "loading", "callback", "generating"]
    procs = [subprocess.Popen([sys.executable, "-c", INTERRUPT, moment, *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for moment in moments]
    for moment, proc in zip(moments, procs):
        if moment in ("loading", "callback", "generating"):
            proc.stdin.write("def f(x):\n")
            proc.stdin.close()  # the prompt is read; stdin stays open for the others
    for moment, proc in zip(moments, procs):
        proc.wait(timeout=120)  # not communicate(): closing stdin would end the wait for a prompt
        stderr = proc.stderr.read()
        assert proc.returncode == 130, (moment, stderr)
        assert stderr.splitlines() == ["Interrupted."], (moment, stderr)


@pytest.mark.parametrize("study, argv", [
    *[("copy_ceiling", a) for a in (["--pairs", "nope"], ["--blocks", "0"], ["--blocks", "x"],
                                    ["--repeats", "0"], ["--tokens", "1"])]])
def test_the_copy_ceiling_study_refuses_bad_arguments_in_one_sentence(
        study, argv, capsys):
    study_main = importlib.import_module(f"bench.studies.{study}").main
    with pytest.raises(SystemExit) as exited:
        study_main(argv)
    assert exited.value.code == 2
    assert ": error: " in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("study", ["plain_loop"])
@pytest.mark.parametrize("argv,message", [(["--pairs", "nope"], "unknown pair 'nope'"),
                                          (["--repeats", "0"], "--repeats must be >= 1")])
def test_plain_step_studies_refuse_bad_arguments_in_one_sentence(study, argv, message, capsys):
    import importlib
    study_main = importlib.import_module(f"bench.studies.{study}").main
    with pytest.raises(SystemExit) as exited:
        study_main(argv)
    assert exited.value.code == 2
    assert f": error: {message}" in capsys.readouterr().err.strip().splitlines()[-1]
