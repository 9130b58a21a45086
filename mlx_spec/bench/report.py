"""The report: headline verdict, then one table per measurement, as terminal text or Markdown.

`sections(result)` turns a `BenchResult` into titled tables once; `render_text`
and `render_markdown` only lay them out. Headlines are ratios and medians;
absolute times appear only inside tables. A drafter on the target's hidden
states (a DFlash block drafter, an EAGLE-3 head) gets its own tables where its
figures differ (a block drafter's pass per round; the runs at k and with the
defaults, from the prompt) and says which phases did not run and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from .. import costmodel
from .acceptance import lookup
from .endtoend import MLX_LM, MLX_SPEC, MLX_SPEC_DEFAULTS, TARGET
from .runner import BenchResult


@dataclass(frozen=True)
class Section:
    title: str
    headers: Sequence[str] = ()
    rows: Sequence[Sequence[str]] = ()
    notes: Sequence[str] = field(default_factory=list)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _drafter_kind(r: BenchResult):
    """The kind of a drafter on the target's hidden states (its runs start from the prompt:
    a block drafter, an EAGLE-3 head), or None for a draft model."""
    return r.block_drafter.kind if r.block_drafter is not None else r.head


def _verdict_section(r: BenchResult) -> Section:
    notes = []
    for v in r.verdicts:
        measured = v.measured_by_k.get(v.best_k) if v.best_k else None
        seen = f", measured {_x(measured)}" if measured is not None else ""
        notes.append(f"T={v.temp:g}: {v.reason} (predicted best {_x(v.predicted_best)}{seen})")
        if measured is not None and (measured >= 1.0) != v.pays:
            notes.append(f"T={v.temp:g}: the measurement disagrees with the cost model; trust "
                         "the measured figure, and rerun with more --repeats on an idle machine.")
    for c in r.end_to_end:
        if _drafter_kind(r) is not None:
            notes.append(f"Measured at T={c.temp:g}: mlx-spec with the {_drafter_kind(r)} "
                         f"is {_x(c.ratios['mlx-spec / target alone'])} the target alone at "
                         f"k={c.k} and {_x(c.ratios.get('mlx-spec defaults / target alone'))} "
                         "with the defaults.")
            continue
        notes.append(f"Measured at T={c.temp:g}, k={c.k}: mlx-spec is "
                     f"{_x(c.ratios['mlx-spec / target alone'])} the target alone and "
                     f"{_x(c.ratios['mlx-spec / mlx-lm speculative'])} mlx-lm speculative.")
    return Section("Verdict: is speculation worth it here?", notes=notes)


def _machine_section(r: BenchResult) -> Section:
    m, b = r.machine, r.bandwidth
    rows = [["chip", m.chip], ["OS", m.os], ["MLX device", m.mlx_device],
            ["memory", f"{m.memory_gb:.1f} GB"], ["CPU cores", str(m.cpu_count)],
            ["BLAS", m.blas], ["MLX / mlx-lm", f"{m.mlx_version} / {m.mlx_lm_version}"],
            ["bandwidth (read / copy)", f"{b.read_gbs:.1f} / {b.copy_gbs:.1f} GB/s "
                                        f"({b.size_mb} MB array)"]]
    rows += [[f"{role} model" if role != "draft" or _drafter_kind(r) is None
              else f"draft ({_drafter_kind(r)})", path] for role, path in r.models.items()]
    return Section("Machine", ("", ""), rows)


def _models_section(r: BenchResult) -> Section:
    rows = []
    for cost in filter(None, (r.target, r.draft)):
        rows.append([cost.role, f"{cost.weight_bytes / 1e6:.1f} MB",
                     f"{cost.decode_s * 1e3:.2f} ms", f"{1 / cost.decode_s:.0f}",
                     _pct(cost.bandwidth_share), cost.cache_kinds or "-", cost.rewind or "-"])
    notes = [] if r.draft is None else [
        f"One draft step costs {r.draft.decode_s / r.target.decode_s:.2f} target steps."]
    return Section("Per model (one decoding step after a "
                   f"{r.target.context_length}-token prefix)",
                   ("model", "weights", "step", "steps/s", "of read bandwidth", "cache layers",
                    "rewind"), rows, notes)


def _block_drafter_sections(r: BenchResult) -> List[Section]:
    d = r.block_drafter
    if d is None:
        return []
    curve = r.target.verify_cost
    rows = [[str(k), str(d.rows_by_k[k]), f"{d.pass_s[k] * 1e3:.2f} ms",
             f"{d.block_s[k] * 1e3:.2f} ms", f"{d.pass_cost[k]:.2f}",
             f"{costmodel.block_round_cost(d.pass_cost[k], k, curve):.2f}"]
            for k in sorted(d.pass_s)]
    return [Section(
        f"{d.kind}: one pass per round (after a {d.context_length}-token context)",
        ("k", "rows in the pass", "pass + catch-up", "proposal alone", "in target steps",
         "round in target steps"), rows,
        [f"{d.kind}, {d.weight_bytes / 1e6:.1f} MB, block of {d.block_size}: one pass drafts "
         "all k, so a round costs that pass (with the catch-up of the k + 1 rows a fully "
         "accepted round hands over) plus the target's verify of k + 1 tokens, not k draft "
         "steps."])]


def _verify_section(r: BenchResult) -> Section:
    models = [c for c in (r.target, r.draft) if c is not None and c.verify_cost]
    rows = [[str(t)] + [f"{c.verify_cost.get(t, 0):.2f}" for c in models]
            for t in sorted(r.target.verify_cost)]
    notes = [f"{c.role}: compute-bound from T={c.compute_bound_at}" if c.compute_bound_at
             else f"{c.role}: memory-bound over the whole range" for c in models]
    return Section("Verify-cost curve: time of one forward over T tokens / time of T=1",
                   ("T", *(c.role for c in models)), rows, notes)


def _acceptance_section(r: BenchResult) -> Section:
    rows = [[str(p.k), f"{p.temp:g}", p.rule, _pct(p.acceptance_rate), f"{p.mean_accepted:.2f}",
             " ".join(map(str, p.accepted_histogram)),
             ", ".join(f"{kind} {_pct(v)}" for kind, v in p.by_kind.items())]
            for p in r.acceptance]
    return Section("Acceptance (exact = mlx-spec's rule; token-match = mlx-lm's rule, same loop)",
                   ("k", "T", "rule", "rate", "mean accepted", "histogram [0..k]", "by kind"),
                   rows)


def _from_prompt_end_to_end_section(r: BenchResult) -> Section:
    rows = []
    for c in r.end_to_end:
        m = c.methods
        token_match = lookup(r.acceptance, c.k, c.temp, "token-match")
        rows.append([f"{c.temp:g}", str(c.k)]
                    + [f"{m[name].tokens_per_s:.1f}" for name in (TARGET, MLX_SPEC,
                                                                  MLX_SPEC_DEFAULTS)]
                    + [_x(c.ratios["mlx-spec / target alone"]),
                       _x(c.ratios.get("mlx-spec defaults / target alone")),
                       _pct(m[MLX_SPEC].acceptance_rate),
                       _pct(m[MLX_SPEC_DEFAULTS].acceptance_rate),
                       _pct(token_match.acceptance_rate) if token_match else "-"])
    return Section(
        f"End to end with the {_drafter_kind(r)}: decode tokens/s, median of "
        f"{r.config.repeats} interleaved repeats of {r.config.max_tokens} tokens",
        ("T", "k", "target", "mlx-spec at k", "mlx-spec defaults", "spec/target",
         "defaults/target", "acc. at k", "acc. defaults", "acc. token-match"), rows,
        ["Defaults: the adaptive policy (up to a block drafter's block), no prompt lookup. "
         "mlx-spec runs "
         "are timed after their first round (the prefill, which feeds the drafter the prompt's "
         "hidden states); acc. token-match is mlx-lm's rule inside mlx-spec's loop."])


def _end_to_end_section(r: BenchResult) -> Section:
    if _drafter_kind(r) is not None:
        return _from_prompt_end_to_end_section(r)
    rows = []
    for c in r.end_to_end:
        m = c.methods
        token_match = lookup(r.acceptance, c.k, c.temp, "token-match")
        rows.append([f"{c.temp:g}", str(c.k)]
                    + [f"{m[name].tokens_per_s:.1f}" if m[name].tokens_per_s else "n/a"
                       for name in (TARGET, MLX_LM, MLX_SPEC)]
                    + [_x(c.ratios["mlx-spec / target alone"]),
                       _x(c.ratios["mlx-spec / mlx-lm speculative"]),
                       _pct(m[MLX_SPEC].acceptance_rate), _pct(m[MLX_LM].acceptance_rate),
                       _pct(token_match.acceptance_rate) if token_match else "-"])
    return Section(
        f"End to end: decode tokens/s, median of {r.config.repeats} interleaved repeats "
        f"of {r.config.max_tokens} tokens",
        ("T", "k", "target", "mlx-lm spec", "mlx-spec", "spec/target", "spec/mlx-lm",
         "acc. mlx-spec", "acc. mlx-lm", "acc. token-match"), rows,
        ["acc. mlx-lm counts mlx-lm's from_draft tokens; acc. token-match is mlx-lm's rule "
         "inside mlx-spec's loop (acceptance sweep). n/a: mlx-lm refuses to speculate with "
         "these caches (recurrent state or a sliding window)."])


def _speedup_section(r: BenchResult) -> Section:
    ks = sorted({k for v in r.verdicts for k in v.predicted_by_k})
    headers = ["k"] + [f"predicted T={v.temp:g}" for v in r.verdicts] + ["measured T=0"]
    rows = [[str(k)] + [_x(v.predicted_by_k.get(k)) for v in r.verdicts]
            + [_x(r.speedup_vs_k.get(k))] for k in ks]
    timed = r.config.timed_prompt_names()
    return Section("Speed-up vs k over the target alone (cost model vs measured)", headers, rows,
                   notes=[f"Both use the prompts the timed runs cycled through: {', '.join(timed)}."])


def _scaling_sections(r: BenchResult) -> List[Section]:
    k = r.config.num_draft_tokens
    context = Section(
        f"Scaling with context length (k={k}, T=0)",
        ("context", "target step", f"verify {k + 1} / 1",
         "draft cost" if r.block_drafter is None else "pass cost", "predicted"),
        [[str(p.context_length), f"{p.target_decode_s * 1e3:.2f} ms", f"{p.verify_cost:.2f}",
          f"{p.draft_cost:.2f}", _x(p.predicted_speedup)] for p in r.context_scaling])
    size = Section(
        f"Scaling with target size (synthetic random targets, real draft, k={k}, T=0 acceptance)",
        ("hidden x layers", "weights", "step", "of bandwidth", f"verify {k + 1} / 1",
         "draft cost", "predicted"),
        [[f"{p.hidden_size} x {p.num_layers}", f"{p.weight_bytes / 1e6:.0f} MB",
          f"{p.decode_s * 1e3:.2f} ms", _pct(p.bandwidth_share), f"{p.verify_cost:.2f}",
          f"{p.draft_cost:.2f}", _x(p.predicted_speedup)] for p in r.size_scaling],
        [f"Not run: {r.skipped['size scaling']}."] if "size scaling" in r.skipped else [])
    b = r.batch_scaling
    batch = Section(
        f"Scaling with batch size (B rows of {b.tokens_per_row} tokens in one target forward)",
        ("B", "time / time(B=1)", "tokens/s"),
        [[str(p.batch), f"{p.relative_cost:.2f}", f"{p.tokens_per_s:.0f}"] for p in b.points],
        [f"Compute-bound from B={b.compute_bound_at}." if b.compute_bound_at
         else "Still memory-bound at the largest B measured."])
    return [context, size, batch]


def _sources_section(r: BenchResult) -> List[Section]:
    race = r.sources
    if race is None:
        return []
    kinds = [kind for kind in race.results[0].speedup if kind != "all"]
    rows = [[res.method] + [_x(res.speedup[kind]) for kind in kinds] + [_x(res.speedup["all"])]
            + [_pct(res.acceptance_rate), _pct(res.lookup_share),
               "-" if res.mean_k is None else f"{res.mean_k:.1f}"]
            for res in race.results]
    return [Section(
        f"Drafting sources and k policy (T={race.temp:g}, {race.max_tokens} tokens, speed-up "
        "over plain decoding, geometric mean over prompts)",
        ["method"] + kinds + ["all", "acceptance", "from lookup", "mean k"], rows,
        [f"Adaptive k vs the best fixed k ({race.best_fixed}): "
         f"{_x(race.adaptive_vs_best_fixed)} over the whole prompt set."]
        + ([f"Every draft row here is the {_drafter_kind(r)}."] if _drafter_kind(r) else []))]


def _trees_section(r: BenchResult) -> List[Section]:
    race = r.tree_race
    if race is None:
        return []
    rows = [[m.method, _x(m.speedup), _x(m.predicted), f"{m.tokens_per_pass:.2f}",
             _pct(m.tree_share), _pct(m.rescued)] for m in race.results]
    chain = race.results[0]
    best = max(race.results[1:-1], key=lambda m: m.speedup, default=None)
    verdict = ("no tree beat the chain here" if best is None or best.speedup <= chain.speedup
               else f"{best.method} beat the chain ({_x(best.speedup)} against "
                    f"{_x(chain.speedup)})")
    return [Section(
        f"Token trees against the chain ({_drafter_kind(r) or 'draft model'}, T={race.temp:g}, "
        f"{race.max_tokens} tokens, speed-up over the target alone)",
        ("method", "measured", "predicted", "tokens per pass", "tree passes", "rescued"), rows,
        [f"A tree k x w verifies k w drafts in one pass (a spine of k, w - 1 siblings beside "
         "each spine node); rescued: of its rounds whose spine stopped short, the share where "
         "a sibling kept a token. Predicted: the cost model on this machine's verify curve, "
         "E(k, w) / (k draft_cost + verify_cost(1 + k w)). Defaults: the policy chooses the "
         f"width each round. Measured: {verdict}."])]


def _skipped_section(r: BenchResult) -> List[Section]:
    if not (r.skipped or r.notes):
        return []
    return [Section("Not run for this draft, and notes",
                    notes=[f"{phase}: not run: {why}." for phase, why in r.skipped.items()]
                    + list(r.notes))]


def sections(r: BenchResult) -> List[Section]:
    return [_verdict_section(r), *_skipped_section(r), _machine_section(r), _models_section(r),
            *_block_drafter_sections(r), _verify_section(r), _acceptance_section(r),
            _end_to_end_section(r), _speedup_section(r), *_scaling_sections(r),
            *_sources_section(r), *_trees_section(r)]


def render_text(r: BenchResult) -> str:
    out = []
    for s in sections(r):
        out += ["", s.title, "-" * len(s.title)]
        if s.rows:
            table = [list(s.headers)] + [list(row) for row in s.rows]
            widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
            out += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                    for row in table if any(row)]
        out += list(s.notes)
    out.append(f"\nBench took {r.elapsed_s:.0f} s.")
    return "\n".join(out)


def render_markdown(r: BenchResult, plots: Sequence[str] = ()) -> str:
    out = ["# mlx-spec bench", ""]
    for s in sections(r):
        out += [f"## {s.title}", ""]
        if s.rows:
            out.append("| " + " | ".join(s.headers) + " |")
            out.append("|" + "---|" * len(s.headers))
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in s.rows]
            out.append("")
        out += [f"- {note}" for note in s.notes]
        out.append("")
    out += [f"![{p}]({p})" for p in plots]
    out.append(f"\nBench took {r.elapsed_s:.0f} s; seed {r.config.seed}; every figure is in "
               "the JSON file.")
    return "\n".join(out) + "\n"
