"""Drafts of another tokenizer, EAGLE-3 heads and token trees beyond one call of generate.

Each case is greedy parity with the target alone, token for token, through one more entry
point: batched rows drafted by an EAGLE-3 head (the engine and `batch_generate`), a
conversation on one reused prompt cache (a draft of another tokenizer keeps the draft ids its
cache holds; a tree round's compacted cache carries over), and suffix drafting in front of
each kind. The fixtures are the kinds' own test files' (test_eagle3, test_cross_tokenizer).
"""

import pytest
from families import plain_greedy
from test_cross_tokenizer import DRAFT_MERGES, byte_bpe, vocab_len
from test_eagle3 import (DEFAULT_IDS, LAYERS, PROMPT, SPECFORGE, SPECULATORS, good_head_tensors,
                         head_tensors, near_bigram, write_head)
from tiny import make_llama, perturbed

from mlx_spec import SuffixIndex, batch_generate, generate, load, stream_generate
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.cache import make_cache
from mlx_spec.drafters import cross_tokenizer
from mlx_spec.eagle3 import is_eagle3_head, load_eagle3


@pytest.fixture(scope="module")
def bigram_head(tmp_path_factory):
    """A near-bigram target and a hand-made head that drafts it well (test_eagle3's)."""
    target = near_bigram(make_llama(vocab_size=64, hidden=48, layers=LAYERS, seed=0))
    path = write_head(tmp_path_factory.mktemp("eagle3") / "head", SPECULATORS, target,
                      good_head_tensors(target, 48, seed=7), DEFAULT_IDS[SPECULATORS])
    return target, load_eagle3(str(path))


@pytest.fixture(scope="module")
def loaded(model_dirs, tmp_path_factory):
    """conftest's target directory loaded with its tokenizer, a perturbed draft of it, and a
    SpecForge head for it (2 layers: explicit taps)."""
    target, tokenizer = load(str(model_dirs["target"]))
    head_dir = write_head(tmp_path_factory.mktemp("head") / "head", SPECFORGE, target,
                          head_tensors(target, 200, seed=6), [0, 1, 1])
    return target, tokenizer, perturbed(target, 0.05, 1), load_eagle3(str(head_dir))


# --- batched rows with an EAGLE-3 head ---------------------------------------------------

@pytest.mark.parametrize("k", [None, 3])
def test_batched_rows_drafted_by_an_eagle3_head_are_each_the_targets_own(bigram_head, k):
    target, head = bigram_head
    prompts = [PROMPT, [3], PROMPT * 2, [5, 9, 14]]
    engine = BatchEngine(target, head, num_draft_tokens=k)
    uids = [engine.insert(RowRequest(p, 40)) for p in prompts]
    tokens, accepted = {u: [] for u in uids}, 0
    while engine.busy:
        for out in engine.step():
            tokens[out.uid] += out.tokens
            accepted += out.num_accepted if out.source == "eagle3" else 0
    for uid, prompt in zip(uids, prompts):
        assert tokens[uid] == plain_greedy(target, prompt, 40)
    assert accepted > 0  # the head's drafts were kept in the batch


def test_one_batched_row_drafts_as_the_head_alone(bigram_head, monkeypatch):
    """One row at a fixed k drafts what a call of its own drafts, round after round, and keeps
    as many: the head's chain is one implementation (head_chain.feed and chain) and the
    batched head reads the same fused taps and pairs."""
    from mlx_spec.batch.mtp import BatchMTP
    from mlx_spec.drafters.eagle3 import Eagle3Drafter
    from mlx_spec.generate import speculative_generate_step

    target, head = bigram_head
    drafted = {"alone": [], "batched": []}
    propose, batch_propose = Eagle3Drafter.propose, BatchMTP.propose

    def spy(self, history, k):
        proposal = propose(self, history, k)
        if proposal is not None:
            drafted["alone"].append(proposal.tokens.tolist())
        return proposal

    def batch_spy(self, rows, k, drawn):
        tokens, q = batch_propose(self, rows, k, drawn)
        drafted["batched"].append(tokens[0, :drawn[0]].tolist())
        return tokens, q

    monkeypatch.setattr(Eagle3Drafter, "propose", spy)
    monkeypatch.setattr(BatchMTP, "propose", batch_spy)
    alone = sum(r.num_accepted for r in speculative_generate_step(
        PROMPT, target, head, max_tokens=40, num_draft_tokens=3, prompt_lookup=False,
        calibration=None))
    engine = BatchEngine(target, head, num_draft_tokens=3)
    engine.insert(RowRequest(PROMPT, 40, prompt_lookup=False))
    batched = 0
    while engine.busy:
        batched += sum(out.num_accepted for out in engine.step())
    assert batched == alone > 0
    assert drafted["batched"] == drafted["alone"] and len(drafted["alone"]) > 3


def test_batch_generate_takes_an_eagle3_head(loaded):
    target, tokenizer, _, head = loaded
    prompts = ["def fibonacci(n):", "return", "    if n < 2:\n"]
    result = batch_generate(target, tokenizer, prompts, draft_model=head, max_tokens=24)
    assert result.texts == [generate(target, tokenizer, p, max_tokens=24, prompt_lookup=False)
                            for p in prompts]


# --- a conversation on one reused prompt cache ------------------------------------------

def _conversation(target, tokenizer, turns, draft=None, **kwargs):
    """Each turn's text, generated on one prompt cache (target layers, then a draft model's;
    an EAGLE-3 head keeps none there)."""
    cache = make_cache(target) + (make_cache(draft) if draft is not None
                                  and not is_eagle3_head(draft) else [])
    texts, stats = [], []
    for ids in turns:
        responses = list(stream_generate(target, tokenizer, ids, draft_model=draft,
                                         prompt_cache=cache, max_tokens=24, calibration=None,
                                         **kwargs))
        texts.append("".join(r.text for r in responses))
        stats.append(responses[-1].stats)
    return texts, stats


def test_a_draft_of_another_tokenizer_keeps_its_cache_across_turns(monkeypatch):
    """Three turns on one cache: the target's own text each turn; from the second turn on the
    draft keeps the ids its cache held (only the new text is fed) and drafts across."""
    target_tok, draft_tok = byte_bpe(), byte_bpe(DRAFT_MERGES)
    target = make_llama(vocab_size=vocab_len(target_tok), seed=0)
    draft = make_llama(vocab_size=vocab_len(draft_tok), seed=7, hidden=32, layers=1)
    turns = [target_tok.encode(t) for t in ("hello world, def the", " the world", " hello")]
    kept = []  # (draft ids the cache kept, ids fed) at each call's draft prefill
    original = cross_tokenizer.prefill
    monkeypatch.setattr(cross_tokenizer, "prefill", lambda cache, tokens, *a, **k: (
        kept.append((cache.length, len(tokens))), original(cache, tokens, *a, **k))[1])
    alone, _ = _conversation(target, target_tok, turns, prompt_lookup=False)
    crossed, stats = _conversation(target, target_tok, turns, draft, draft_tokenizer=draft_tok,
                                   num_draft_tokens=3, prompt_lookup=False)
    assert crossed == alone
    assert len(kept) == 3 and kept[0][0] == 0
    assert all(held > 20 and fed < held for held, fed in kept[1:]), kept
    assert all(sum(r for r, _, _ in s.cross_rules.values()) > 0 for s in stats)


def test_token_trees_on_a_reused_prompt_cache(loaded):
    target, tokenizer, draft, _ = loaded
    turns = [tokenizer.encode(t) for t in ("def fibonacci(n):", "\n    return", " n - 1")]
    alone, _ = _conversation(target, tokenizer, turns, prompt_lookup=False)
    trees, stats = _conversation(target, tokenizer, turns, draft, tree=(3, 2),
                                 num_draft_tokens=3, prompt_lookup=False)
    assert trees == alone
    assert all(s.tree_rounds > 0 for s in stats)


def test_an_eagle3_head_on_a_reused_prompt_cache_with_lookup_in_front(loaded):
    target, tokenizer, _, head = loaded
    turns = [tokenizer.encode(t) for t in ("def fibonacci(n):", "\n    return", " n - 1")]
    alone, _ = _conversation(target, tokenizer, turns, prompt_lookup=False)
    drafted, _ = _conversation(target, tokenizer, turns, head, prompt_lookup=True)
    assert drafted == alone


# --- suffix drafting in front -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["eagle3", "cross", "tree"])
def test_suffix_drafting_in_front_of_each_kind(kind, loaded):
    """Two calls on one SuffixIndex: the second drafts from the first's text first."""
    target, tokenizer, draft, head = loaded
    kwargs = {"eagle3": dict(draft_model=head),
              "cross": dict(draft_model=make_llama(vocab_size=vocab_len(byte_bpe()), seed=7,
                                                   hidden=32, layers=1)),
              "tree": dict(draft_model=draft, tree=(3, 2), num_draft_tokens=3)}[kind]
    if kind == "cross":  # the target's own tokenizer beside a byte-level BPE of other merges
        kwargs["draft_tokenizer"] = byte_bpe()
    index = SuffixIndex()
    prompt = "def fibonacci(n):"
    alone = generate(target, tokenizer, prompt, max_tokens=32, prompt_lookup=False)
    for _ in range(2):
        responses = list(stream_generate(target, tokenizer, prompt, max_tokens=32,
                                         suffix=index, calibration=None, **kwargs))
        assert "".join(r.text for r in responses) == alone
    assert responses[-1].stats.accepted_by_source.get("suffix", 0) > 10


# --- mlx-spec check -----------------------------------------------------------------------

def test_the_exactness_check_runs_token_trees(loaded, model_dirs, monkeypatch):
    """check_exactness(tree=) verifies trees (every sample's round a tree round) and passes;
    `mlx-spec check --tree 2x3` runs it from the command line."""
    from click.testing import CliRunner

    from mlx_spec import loop
    from mlx_spec.cli import main
    from mlx_spec.exactness import check_exactness
    from mlx_spec.sampling import SamplingConfig

    target, tokenizer, draft, _ = loaded
    trees = []
    original = loop.tree_round
    monkeypatch.setattr(loop, "tree_round", lambda *a: trees.append(1) or original(*a))
    result = check_exactness(target, draft, tokenizer.encode("def fibonacci(n):"),
                             SamplingConfig(temp=1.0), samples=150, tree=(2, 3))
    assert result.passed and result.drafted > 0 and len(trees) >= 150, (result, len(trees))
    checked = CliRunner().invoke(main, ["check", "--model", str(model_dirs["target"]),
                                        "--draft-model", str(model_dirs["draft"]),
                                        "--tree", "2x3", "--samples", "100"])
    assert checked.exit_code == 0 and "indistinguishable" in checked.output, checked.output


# --- mlx-spec tune ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["eagle3", "cross"])
def test_tune_measures_a_head_and_a_draft_of_another_tokenizer(kind, model_dirs, loaded,
                                                               tmp_path, monkeypatch):
    """`mlx-spec tune --draft-model` stores the head's (or the foreign draft's) costs; a call
    then starts its policy from them and still gives the target's own text."""
    from click.testing import CliRunner

    from mlx_spec.assemble import cost_prior
    from mlx_spec.calibration import load_calibration
    from mlx_spec.cli import main
    from mlx_spec.sampling import SamplingConfig

    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    target, tokenizer, _, _ = loaded
    if kind == "eagle3":
        draft_dir = write_head(tmp_path / "head", SPECFORGE, target,
                               head_tensors(target, 200, seed=6), [0, 1, 1])
        draft, source, name = load_eagle3(str(draft_dir)), "eagle3", "EAGLE-3 head"
    else:
        draft_dir = model_dirs["foreign"]
        draft, source, name = load(str(draft_dir))[0], "draft", "draft"
    tuned = CliRunner().invoke(main, ["tune", "--model", str(model_dirs["target"]),
                                      "--draft-model", str(draft_dir)])
    assert tuned.exit_code == 0 and name in tuned.stdout, tuned.output
    calibration = load_calibration(target)
    prior = cost_prior(calibration, target, None if kind == "eagle3" else draft,
                       SamplingConfig(), eagle3_head=draft if kind == "eagle3" else None)
    assert prior.knows(source)
    prompt = "def fibonacci(n):"
    assert generate(target, tokenizer, prompt, draft_model=draft, max_tokens=32) == \
        generate(target, tokenizer, prompt, max_tokens=32, prompt_lookup=False)


# --- mlx-spec bench -----------------------------------------------------------------------

def test_bench_measures_a_draft_of_another_tokenizer_and_an_eagle3_head(model_dirs, loaded,
                                                                        tmp_path):
    """Every phase runs with a draft of another tokenizer but mlx-lm's speculative column (it
    would read the draft's ids as the target's), listed as skipped with the reason; an
    EAGLE-3 head runs every phase but mlx-lm's column and the size scaling (listed), its
    chained step as the draft step, its runs from the prompt at k and with the defaults, and
    the saved result re-renders (the command line: test_eagle3)."""
    import json

    from click.testing import CliRunner

    from mlx_spec.bench.endtoend import MLX_SPEC, MLX_SPEC_DEFAULTS
    from mlx_spec.bench.report import render_markdown
    from mlx_spec.bench.runner import BenchResult, run_bench, tiny_config
    from mlx_spec.bench.serialize import from_dict
    from mlx_spec.cli import main

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(model_dirs["target"]), "--draft-model",
        str(model_dirs["foreign"]), "--smoke", "--json", str(out), "--max-tokens", "6",
        "--repeats", "1", "--no-plots"])
    assert result.exit_code == 0, result.output
    measured = json.loads(out.read_text())
    assert "target's tokenizer" in measured["skipped"]["mlx-lm speculative"]
    assert sum(p["drafted"] for p in measured["acceptance"]) > 0
    target, tokenizer, _, head = loaded
    bench = run_bench(target, head, tokenizer, tiny_config(), models={"target": "t", "draft": "h"})
    assert bench.head == "EAGLE-3 head" and bench.block_drafter is None
    assert set(bench.skipped) == {"size scaling", "mlx-lm speculative"}
    trees = {m.method: m for m in bench.tree_race.results}  # the head's trees raced too
    assert trees["tree 2x2"].tree_share > 0 and trees["chain k=2"].tree_share == 0
    assert bench.draft.decode_s > 0 and bench.draft.verify_cost == {}
    assert sum(p.drafted for p in bench.acceptance) > 0
    for c in bench.end_to_end:  # at k and with the defaults, each drafting
        assert c.methods[MLX_SPEC].tokens_per_s > 0 and c.methods[MLX_SPEC_DEFAULTS].tokens_per_s > 0
        assert c.methods[MLX_SPEC].acceptance_rate is not None
    assert bench.size_scaling == [] and all(p.draft_cost > 0 for p in bench.context_scaling)
    assert set(bench.speedup_vs_k) == set(tiny_config().speedup_ks)
    report = render_markdown(bench)
    assert "draft (EAGLE-3 head)" in report and "End to end with the EAGLE-3 head" in report
    again = from_dict(BenchResult, json.loads(json.dumps(bench.as_dict())))
    assert again.head == bench.head and render_markdown(again) == report
