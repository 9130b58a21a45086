"""Suffix drafting in `mlx-spec serve`: who drafts from whose text, the file, the switch.

The real server on a free local port with the shipped pair, greedy, k pinned
(a fixed policy: the counts repeat exactly). A prompt's second request with
the same API key repeats the first's text with nearly every token a suffix
draft; a request with another key, or none, drafts no more than from a fresh
index (exactly as many: its own text only), and its partition holds only its
own text; with scope `all` the same second request does draft from the first
(the control that shows the measurement sees sharing). Indexes saved at
shutdown are drafted from after a restart, and the file names partitions by a
digest, never by the key. A corrupt file or a bad flag combination stops
`mlx-spec serve` with one sentence. `suffix: false` in a body turns it off for
that request.
"""

import hashlib
import signal

import pytest
from click.testing import CliRunner

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402

from serve_process import serving, stop  # noqa: E402

from mlx_spec import generate, load_default_pair  # noqa: E402
from mlx_spec.cli import main  # noqa: E402
from mlx_spec.cli.serve import SUFFIX_SCOPES  # noqa: E402
from mlx_spec.drafters.suffix_index import (DEFAULT_SUFFIX_TOKENS, SuffixIndex,  # noqa: E402
                                            load_indexes, save_indexes)
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.prompts import completion_prompt_ids  # noqa: E402
from mlx_spec.server.requests import Settings  # noqa: E402
from mlx_spec.server.suffix_scope import SCOPES, SuffixScopes, bearer_key  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.worker import GenerationWorker  # noqa: E402

MODEL_ID = "mlx-spec-default"
PROMPT = "def quicksort(xs):"
MAX_TOKENS = 40
K = 8  # pinned: a fixed policy, so every count below repeats exactly


@pytest.fixture(scope="module", params=[GenerationWorker, batched_worker], ids=["serial", "batched"])
def pair(request):
    """The shipped pair and the worker to serve it with (one request at a time, or batched)."""
    return (*load_default_pair(), request.param)


class Server:
    """A server on a free port for one test; `stop()` shuts it down (saving any file)."""

    def __init__(self, pair, scopes, defaults=Settings(suffix=True)):
        target, draft, tokenizer, kind = pair
        self.worker = kind(target, tokenizer, draft, suffix=scopes)
        self.scopes = scopes
        self.server, self.thread, self.url = serve_in_background(
            create_app(self.worker, MODEL_ID, defaults))

    def complete(self, key=None, **fields):
        """(text, completion tokens, tokens accepted from suffix drafts)."""
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "num_draft_tokens": K, **fields}
        response = httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        suffix = answer["speculation"]["accepted_by_source"].get("suffix", 0)
        return answer["choices"][0]["text"], answer["usage"]["completion_tokens"], suffix

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive() and not self.worker._thread.is_alive()


def digest(key):
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_key_drafts_from_its_own_earlier_requests_and_no_one_elses(pair):
    server = Server(pair, SuffixScopes("key"))
    try:
        text, n, fresh = server.complete("alice")
        again, n2, repeated = server.complete("alice")
        other, _, other_suffix = server.complete("bob")
        anonymous, _, anonymous_suffix = server.complete(None)
        health = httpx.get(server.url + "/health", timeout=30).json()["suffix"]
    finally:
        server.stop()
    target, draft, tokenizer, _ = pair
    ids = completion_prompt_ids(tokenizer, PROMPT, 4096)
    assert text == generate(target, tokenizer, ids, draft_model=draft, max_tokens=MAX_TOKENS)
    assert again == other == anonymous == text and n == n2 == MAX_TOKENS
    assert repeated >= 0.9 * n and repeated > fresh  # the second time: nearly all suffix drafts
    assert other_suffix == anonymous_suffix == fresh  # its own text only, as a fresh index
    alice, bob = server.scopes.peek(digest("alice")), server.scopes.peek(digest("bob"))
    assert alice.num_sequences == 2 and bob.num_sequences == 1
    assert bob.sequences()[0][:len(ids)] == ids  # bob's partition holds bob's own request only
    assert health["scope"] == "key" and health["partitions"] == 2  # none for the keyless request
    assert health["tokens"] == len(alice) + len(bob)


def test_scope_all_shares_every_request(pair):
    """The control: with one index for all, the same measurement sees another key's text."""
    server = Server(pair, SuffixScopes("all"))
    try:
        _, n, fresh = server.complete("alice")
        _, _, shared = server.complete("bob")
    finally:
        server.stop()
    assert shared >= 0.9 * n and shared > fresh


def test_suffix_false_in_a_body_turns_it_off_for_that_request(pair):
    server = Server(pair, SuffixScopes("key"))
    try:
        text, _, off = server.complete("alice", suffix=False)
        held = server.scopes.peek(digest("alice"))
        same, _, on = server.complete("alice", suffix=True)
        refused = httpx.post(server.url + "/v1/completions", timeout=30,
                             json={"prompt": PROMPT, "suffix": " return xs"})
    finally:
        server.stop()
    assert off == 0 and held is None and on > 0 and same == text
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_parameter"
    # and a server started without --suffix drafts from it only when a request asks
    quiet = Server(pair, SuffixScopes("key"), Settings())
    try:
        _, _, default = quiet.complete("alice")
        _, _, asked = quiet.complete("alice", suffix=True)
    finally:
        quiet.stop()
    assert default == 0 and asked > 0


def test_the_file_is_saved_at_shutdown_and_drafted_from_after_a_restart(pair, tmp_path):
    path = tmp_path / "suffix.npz"
    first = Server(pair, SuffixScopes("key", path=path))
    try:
        text, n, fresh = first.complete("alice")
    finally:
        first.stop()
    saved = load_indexes(path)
    assert list(saved) == [digest("alice")] and "alice" not in path.read_bytes().decode("latin-1")
    second = Server(pair, SuffixScopes("key", path=path))
    try:
        again, _, repeated = second.complete("alice")
        _, _, other = second.complete("bob")
    finally:
        second.stop()
    assert again == text and repeated >= 0.9 * n and repeated > fresh and other == fresh
    assert set(load_indexes(path)) == {digest("alice"), digest("bob")}


def test_the_cli_refuses_a_corrupt_or_foreign_file_and_bad_flags_in_one_sentence(tmp_path):
    runner = CliRunner()
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip file")
    foreign = tmp_path / "all.npz"
    save_indexes(foreign, {"*": SuffixIndex()})
    other_vocabulary = tmp_path / "vocab.npz"
    save_indexes(other_vocabulary, {"*": SuffixIndex(vocab_size=7)})
    for path, scope, words in ((corrupt, "key", "is not a suffix index"),
                               (foreign, "key", "another scope"),
                               (other_vocabulary, "all", "vocabulary of 7")):
        result = runner.invoke(main, ["serve", "--port", "0", "--suffix-scope", scope,
                                      "--suffix-file", str(path)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and words in lines[0], result.output
        assert lines[0].startswith("Error: ") and "Traceback" not in result.output
    bad = runner.invoke(main, ["serve", "--suffix-scope", "request", "--suffix-file",
                               str(tmp_path / "x.npz")])
    assert bad.exit_code == 2 and "--suffix-scope request" in bad.output
    assert runner.invoke(main, ["serve", "--suffix-scope", "everyone"]).exit_code == 2
    assert SUFFIX_SCOPES == SCOPES  # the CLI's copy (it imports no MLX for --help)
    assert str(DEFAULT_SUFFIX_TOKENS) in runner.invoke(main, ["serve", "--help"]).output


def test_sigterm_saves_the_index_of_the_real_command(tmp_path):
    path = tmp_path / "suffix.npz"
    with serving("--suffix", "--suffix-scope", "all", "--suffix-file", path) as (proc, _, url):
        response = httpx.post(url + "/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 8})
        assert response.status_code == 200
        stop(proc, signal.SIGTERM, 0)
    index = load_indexes(path)["*"]
    assert index.num_sequences == 1 and len(index) >= 8


def test_partitions_are_digests_capped_and_within_the_budget():
    assert bearer_key("Bearer  k1 ") == "k1" and bearer_key("Basic k1") is None
    assert bearer_key(None) is None and bearer_key("Bearer ") is None
    scopes = SuffixScopes("key", max_tokens=1000)
    assert scopes.partition("Bearer k1") == digest("k1") and scopes.partition(None) is None
    assert SuffixScopes("all").partition("Bearer k1") == "*"
    assert SuffixScopes("request").partition("Bearer k1") is None
    assert scopes.index_for(None) is not scopes.index_for(None)  # a fresh one each time
    for i in range(70):
        scopes.index_for(digest(f"k{i}")).add([1, 2, 3])
    assert scopes.summary()["partitions"] == 64 and scopes.peek(digest("k5")) is None
    assert scopes.peek(digest("k6")) is not None
    scopes.index_for(digest("big")).add(list(range(900)))
    scopes.index_for(digest("big"))  # its next request: the least recent others make room
    summary = scopes.summary()
    assert summary["tokens"] <= 1000 and len(scopes.peek(digest("big"))) == 900
    assert scopes.peek(digest("k69")) is not None and scopes.peek(digest("k6")) is None
    with pytest.raises(ValueError, match="scope request"):
        SuffixScopes("request", path="x.npz")
    with pytest.raises(ValueError, match="one of"):
        SuffixScopes("everyone")
