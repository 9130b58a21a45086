"""`mlx-spec bench --distributed`, run on every rank of an `mlx.launch`: a sharded target's costs.

Every rank runs the same measurements (their collectives must meet); rank 0
reports. Three figures:

- **end to end**: tokens/s of the sharded target alone (plain decoding) and
  with speculation (the draft on every rank, the default adaptive policy), greedy,
  over the quick prompt set, after one warm-up generation (each run's prefill
  and first round are not timed);
- **verify cost**: seconds of one sharded forward over T tokens after a
  128-token context, T = 1, 2, 4, 8, 16 (interleaved medians; forward.verify_curve,
  as `mlx-spec bench` measures it), and the ratio to T = 1;
- **communication**: the same collectives a forward issues, timed alone (tensor
  parallel: two all-sums of (1, T, hidden) per layer; pipeline: the stage
  hand-offs and the closing all-gather), plus the rank agreement's small
  all-sums; as seconds per pass and as a share of the whole pass.
"""

from __future__ import annotations

import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List

import mlx.core as mx

from .forward import verify_curve
from .prompts import QUICK_PROMPTS
from .timing import interleaved_medians, time_after_prefill

VERIFY_SIZES = (1, 2, 4, 8, 16)
CONTEXT_TOKENS = 128
VERIFY_REPEATS = 3
DEFAULT_MAX_TOKENS = 48


@dataclass
class DistributedResult:
    ranks: int
    sharding: str
    target: str
    draft: str
    machine: Dict[str, str]
    max_tokens: int
    plain_tps: List[float] = field(default_factory=list)  # one per prompt
    speculative_tps: List[float] = field(default_factory=list)
    tokens_per_round: List[float] = field(default_factory=list)
    verify_seconds: Dict[int, float] = field(default_factory=dict)  # T -> seconds per pass
    communication_seconds: Dict[int, float] = field(default_factory=dict)  # T -> seconds
    agreement_seconds: float = 0.0  # the agreement's all-sums of one speculative round

    @property
    def speedup(self) -> float:
        return statistics.median(self.speculative_tps) / statistics.median(self.plain_tps)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["speedup"] = self.speedup
        out["communication_share"] = {t: self.communication_seconds[t] / s
                                      for t, s in self.verify_seconds.items()}
        return out


def sharding_of(target_model) -> str:
    inner = getattr(target_model, "model", None)
    return "pipeline" if getattr(inner, "pipeline_size", 1) > 1 else "tensor"


def generation_tps(target_model, draft_model, prompt: List[int], max_tokens: int):
    """(tokens/s, tokens per round) of one greedy generation, prefill excluded."""
    from ..generate import speculative_generate_step

    decoded = time_after_prefill(speculative_generate_step(
        prompt, target_model, draft_model, max_tokens=max_tokens,
        prompt_lookup=draft_model is not None, calibration=None))
    return (decoded.tokens / decoded.seconds,
            (decoded.tokens + decoded.first_tokens) / (decoded.rounds + 1))


def verify_seconds(target_model) -> Dict[int, float]:
    """Seconds of one target forward over T tokens after CONTEXT_TOKENS of context."""
    return verify_curve(target_model, VERIFY_SIZES, CONTEXT_TOKENS, VERIFY_REPEATS)


def collectives_alone(target_model, group, sharding: str, sizes=VERIFY_SIZES,
                      repeats: int = 5) -> Dict[int, float]:
    """Seconds of the collectives one forward over T tokens issues, with no model maths."""
    args = target_model.args
    hidden, layers = args.hidden_size, args.num_hidden_layers
    dtype = target_model.model.embed_tokens.weight.dtype
    rank, size = group.rank(), group.size()

    def tensor_parallel(x):
        for _ in range(2 * layers):  # attention and MLP outputs, each summed over the ranks
            x = mx.distributed.all_sum(x, group=group) * 0.5
        return x

    def pipeline(x):
        if rank < size - 1:
            x = mx.distributed.recv_like(x, rank + 1, group=group)
        if rank != 0:
            x = mx.distributed.send(x, rank - 1, group=group)
        return mx.distributed.all_gather(x, group=group)[:1]

    shape_pass = tensor_parallel if sharding == "tensor" else pipeline

    def run(t):
        return lambda: mx.eval(shape_pass(mx.ones((1, t, hidden), dtype)))

    return interleaved_medians({t: run(t) for t in sizes}, repeats=repeats)


def agreement_alone(group, num_draft_tokens: int = 4, repeats: int = 5) -> float:
    """Seconds of the rank agreement's two all-sums of one speculative round."""
    from ..distributed import RankAgreement

    agreement = RankAgreement(group)

    def run():
        drafts = agreement.broadcast(mx.zeros((num_draft_tokens,), mx.uint32))
        mx.eval(agreement.decide(mx.concatenate([drafts, drafts[:2]])))
        agreement.received()

    return interleaved_medians({0: run}, repeats=repeats)[0]


def run_distributed_bench(target_model, draft_model, tokenizer, group, models: Dict[str, str],
                          max_tokens: int = DEFAULT_MAX_TOKENS,
                          progress: Callable[[str], None] = lambda m: None) -> DistributedResult:
    """Every measurement above, on every rank in the same order."""
    sharding = sharding_of(target_model)
    result = DistributedResult(group.size(), sharding, models["target"], models["draft"],
                               {"platform": platform.platform(), "processor": platform.machine(),
                                "mlx": mx.__version__, "device": str(mx.default_device())},
                               max_tokens)
    prompts = [tokenizer.encode(p.text) for p in QUICK_PROMPTS]
    generation_tps(target_model, draft_model, prompts[0], 8)  # warm-up
    for prompt, spec in zip(prompts, QUICK_PROMPTS):
        progress(f"end to end: {spec.name}, the target alone, then with the draft")
        result.plain_tps.append(generation_tps(target_model, None, prompt, max_tokens)[0])
        tps, per_round = generation_tps(target_model, draft_model, prompt, max_tokens)
        result.speculative_tps.append(tps)
        result.tokens_per_round.append(per_round)
    progress("verify cost of the sharded target")
    result.verify_seconds = verify_seconds(target_model)
    progress("the collectives of one pass, alone")
    result.communication_seconds = collectives_alone(target_model, group, sharding)
    result.agreement_seconds = agreement_alone(group)
    return result


def render_markdown(result: DistributedResult) -> str:
    d = result.as_dict()
    lines = [
        f"# Sharded target: {result.ranks} ranks, {result.sharding} parallel",
        "",
        f"Target `{result.target}`, draft `{result.draft}`; {result.machine['platform']}, "
        f"MLX {result.machine['mlx']} ({result.machine['device']}); greedy, "
        f"{result.max_tokens} tokens per prompt, prefill excluded.",
        "",
        "| prompt | target alone, tok/s | speculative, tok/s | tokens/round |",
        "|---|---:|---:|---:|",
    ]
    for spec, plain, fast, per in zip(QUICK_PROMPTS, result.plain_tps, result.speculative_tps,
                                      result.tokens_per_round):
        lines.append(f"| {spec.name} | {plain:.1f} | {fast:.1f} | {per:.2f} |")
    lines += [
        "",
        f"Speed-up (median over median): {d['speedup']:.2f}x.",
        "",
        "| T (tokens per pass) | pass, ms | vs T = 1 | collectives alone, ms | share |",
        "|---:|---:|---:|---:|---:|",
    ]
    base = result.verify_seconds[min(result.verify_seconds)]
    for t, seconds in sorted(result.verify_seconds.items()):
        comm = result.communication_seconds[t]
        lines.append(f"| {t} | {seconds * 1e3:.1f} | {seconds / base:.2f} | {comm * 1e3:.1f} | "
                     f"{comm / seconds:.0%} |")
    lines += ["", f"The rank agreement's two all-sums per speculative round, alone: "
                  f"{result.agreement_seconds * 1e3:.1f} ms.", ""]
    return "\n".join(lines)

