"""mlx-lm's chat template options: a chat request's `chat_template_kwargs` (over the server's
`--chat-template-args`) reach the tokenizer's template (e.g. Qwen3's `enable_thinking`),
`serve --chat-template` replaces the template, and `generate --chat-template-config` and
`--system-prompt` shape the prompt as mlx-lm's generate does. What is not a JSON object, or
sets what the server sets itself, is one sentence.
"""

import pytest
from click.testing import CliRunner

from mlx_spec.cli import main
from mlx_spec.server.requests import RequestError, Settings, parse_request

# A template that reads a keyword argument, as Qwen3's reads enable_thinking (which mlx-lm's
# tokenizer wrapper sets itself when not given)
STYLED = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}{% if style is defined %}assistant ({{ style }}):"
          "{% else %}assistant:{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "def f(x):"}]


def test_a_requests_kwargs_go_over_the_servers():
    defaults = Settings(chat_template_kwargs=(("enable_thinking", True), ("style", "terse")))
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    request = parse_request(body, True, "tiny", defaults)
    assert dict(request.settings.chat_template_kwargs) == {"enable_thinking": False,
                                                           "style": "terse"}
    plain = parse_request({"messages": MESSAGES}, True, "tiny", defaults)
    assert plain.settings.chat_template_kwargs == defaults.chat_template_kwargs
    for bad, says in (([1], "must be an object"), ({"tokenize": False}, "may not set 'tokenize'"),
                      ({"add_generation_prompt": False}, "may not set"),
                      ({"chat_template": "{{ 1 }}"}, "may not set 'chat_template'"),
                      ({"tools": [{"type": "function"}]}, "may not set 'tools'"),
                      ({"continue_final_message": True}, "may not set")):
        with pytest.raises(RequestError, match=says) as error:
            parse_request({**body, "chat_template_kwargs": bad}, True, "tiny")
        assert error.value.status == 400 and error.value.param == "chat_template_kwargs"


@pytest.fixture()
def chat(model_dirs):
    from mlx_spec import load

    target, tokenizer = load(str(model_dirs["chat"]))
    tokenizer.chat_template = STYLED
    return target, tokenizer


def test_the_template_reads_them(chat):
    from mlx_spec.server.prompts import chat_prompt_ids

    _, tokenizer = chat
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES)).endswith("assistant:")
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"style": "terse"})).endswith(
        "assistant (terse):")


def test_the_server_renders_a_chat_with_them(chat):
    import httpx

    from mlx_spec.server.app import create_app, serve_in_background
    from mlx_spec.server.prompts import chat_prompt_ids
    from mlx_spec.server.worker import GenerationWorker, SpeculationOptions

    target, tokenizer = chat
    worker = GenerationWorker(target, tokenizer, None, SpeculationOptions(calibration=None))
    defaults = Settings(max_tokens=4, chat_template_kwargs=(("style", "terse"),))
    server, thread, url = serve_in_background(create_app(worker, "tiny", defaults))

    def prompt_tokens(**fields):
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, **fields}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        return answer["usage"]["prompt_tokens"]
    try:
        by_default = prompt_tokens()
        overridden = prompt_tokens(chat_template_kwargs={"style": "a much longer one"})
        refused = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MESSAGES, "chat_template_kwargs": "no"})
    finally:
        server.should_exit = True
        thread.join(30)
    assert by_default == len(chat_prompt_ids(tokenizer, MESSAGES, {"style": "terse"}))
    assert overridden == len(chat_prompt_ids(tokenizer, MESSAGES,
                                             {"style": "a much longer one"})) != by_default
    assert refused.status_code == 400 and "chat_template_kwargs" in refused.text


def test_generate_takes_mlx_lms_template_options(tmp_path):
    from tiny import write_model_dir

    from mlx_spec import generate, load

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if lang is defined %}({{ lang }}){% endif %}")
    path = write_model_dir(tmp_path / "m", chat_template=template)
    target, tokenizer = load(str(path))
    user, system = {"role": "user", "content": "def f"}, {"role": "system", "content": "be"}

    def expected(messages, **kwargs):
        return generate(target, tokenizer, tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs), max_tokens=12)

    def cli(*args):
        result = CliRunner().invoke(main, ["generate", "-m", str(path), "-n", "12", "-q",
                                           "--no-draft", "--prompt", "def f", *args])
        assert result.exit_code == 0, result.output
        return result.stdout[:-1]  # (the line's end after the text)
    cases = [((), expected([user])),
             (("--system-prompt", "be"), expected([system, user])),
             (("--system-prompt", "be", "--chat-template-config", '{"lang": "py"}'),
              expected([system, user], lang="py"))]
    assert len({text for _, text in cases}) > 1  # the options change the text here
    for args, text in cases:
        assert cli(*args) == text, args
    for value, says in (("{oops", "not JSON"),
                        ('{"continue_final_message": true}', "may not set")):
        bad = CliRunner().invoke(main, ["generate", "-n", "4", "--chat-template-config", value])
        assert bad.exit_code == 2 and says in bad.output, bad.output


def test_serve_refuses_a_bad_template_args_in_one_sentence():
    for value, says in (("[1]", "must be an object"), ("{x", "not JSON"),
                        ('{"tokenize": true}', "may not set 'tokenize'")):
        result = CliRunner().invoke(main, ["serve", "--chat-template-args", value])
        assert result.exit_code == 2 and says in result.output, result.output


def test_serve_takes_a_template_and_its_args(model_dirs):
    import httpx
    from serve_process import serving, stop

    from mlx_spec import load
    from mlx_spec.server.prompts import chat_prompt_ids

    _, tokenizer = load(str(model_dirs["chat"]))
    tokenizer.chat_template = STYLED
    with serving("--model", model_dirs["chat"], "--no-draft", "--chat-template", STYLED,
                 "--chat-template-args", '{"style": "terse"}') as (proc, line, url):
        body = {"model": "default", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
        answer = httpx.post(url + "/chat/completions", json=body, timeout=60).json()
        stop(proc, 2, 130)  # SIGINT
    assert answer["usage"]["prompt_tokens"] == len(
        chat_prompt_ids(tokenizer, MESSAGES, {"style": "terse"}))
