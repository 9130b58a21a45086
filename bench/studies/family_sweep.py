"""Every mlx-lm family through every path: a sweep for exactness faults.

    python -m bench.studies.family_sweep [FAMILY ...] [--out family-sweep]

For each of mlx-lm's model classes (FAMILIES, and variants: "a+b" wraps text model b in
multimodal wrapper a, "name@variant" another layout of that class) a tiny random float32
instance (hidden 32-64, vocab 64, tests/families.settled's scaled weights; the first seed
of 0-3 whose greedy reply has 6 distinct tokens), drafted for by its own weights perturbed
(noise 0.05), each in a process of its own: its greedy tokens (24 after an 8-token prompt)
through a call with chains and with trees (3x2), rows side by side (two prompts of other
lengths; chains, trees) and one row at a time (BatchEngine(max_rows=1)), each against the
target's own greedy decoding; `positions_follow` (the tree probe) and `batchable` recorded.
A cell is ok, WRONG (the first differing token), refused (a one-sentence ValueError) or
crash. Writes bench/results/<out>.md (the table) and .jsonl (with tracebacks).

Found on December 7 (a first run, on code that changed under it): GPT-2's and GPT BigCode's
trees gave wrong text; Nemotron-NAS's linear attention layers crashed trees and the batch;
DeepSeek-V4.1's cache crashed a row alone; Phixtral's vocabulary was not read. Fixed; the
published run is on the fixed code.
"""
import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # (tests/families.py: settled, plain_greedy)

FAMILIES = [
    'Klear', 'afm7', 'afmoe', 'apertus', 'baichuan_m1', 'bailing_hybrid', 'bailing_moe',
    'bailing_moe_linear', 'bailing_moe_v3', 'bitnet', 'cohere', 'cohere2', 'dbrx', 'deepseek',
    'deepseek_v2', 'deepseek_v3', 'deepseek_v32', 'deepseek_v41', 'dots1', 'ernie4_5',
    'ernie4_5_moe', 'exaone', 'exaone4', 'exaone_moe', 'falcon_h1', 'gear', 'gemma', 'gemma2',
    'gemma3', 'gemma3_text', 'gemma3n', 'gemma4', 'gemma4_text', 'gemma4_text@shared', 'glm',
    'glm4', 'glm4_moe', 'glm4_moe_lite', 'glm_moe_dsa', 'gpt2', 'gpt_bigcode', 'gpt_neox',
    'gpt_oss', 'gptj', 'granite', 'granitemoe', 'granitemoehybrid', 'helium', 'hunyuan',
    'hunyuan_v1_dense', 'internlm2', 'internlm3', 'iquestloopcoder', 'jamba', 'kimi_k25',
    'kimi_k3', 'kimi_linear', 'kimi_vl', 'laguna', 'lfm2', 'lfm2-vl', 'lfm2_moe', 'lille-130m',
    'llama', 'llama4', 'llama4_text', 'longcat_flash', 'longcat_flash_ngram', 'mamba',
    'mamba2', 'mellum', 'mimo', 'mimo_v2_flash', 'minicpm', 'minicpm3', 'minimax',
    'minimax_m3_vl', 'ministral3', 'mistral3', 'mistral3+ministral3', 'mistral3+mistral4',
    'mistral4', 'mixtral', 'muse_glimmer', 'muse_spark', 'nanbeige', 'nanochat', 'nemotron',
    'nemotron-nas', 'nemotron-nas@linear', 'nemotron-nas@noop', 'nemotron_h', 'olmo', 'olmo2',
    'olmo3', 'olmo_hybrid', 'olmoe', 'openelm', 'phi', 'phi3', 'phi3small', 'phimoe',
    'phixtral', 'pixtral', 'plamo', 'plamo2', 'plamo3', 'prism_hadamard_qwen35', 'qwen',
    'qwen2', 'qwen2_moe', 'qwen2_vl', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_moe',
    'qwen3_next', 'qwen3_vl', 'qwen3_vl_moe', 'recurrent_gemma', 'rwkv7', 'seed_oss',
    'smollm3', 'solar_open', 'spark2_5', 'stablelm', 'starcoder2', 'step3p5', 'talkie',
    'telechat3', 'youtu_llm']

P = [5, 17, 3, 40, 9, 5, 17, 3]
P2 = [1, 2, 3]
N = 24

BASE = dict(
    hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=64, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, rope_scaling=None,
    layer_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5,
    # MoE
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_routed_experts=4,
    n_shared_experts=1, num_shared_experts=1, shared_expert_intermediate_size=32,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1,
    num_local_experts=4, moe_k=2, moe_num_experts=4, moe_topk=2, num_shared_expert=1,
    use_mixed_mlp_moe=False,
    # MLA
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    attention_bias=False, mlp_bias=False, use_bias=False, use_qkv_bias=False,
    # GPT-style names
    n_embd=32, n_layer=2, n_head=4, n_positions=4096, n_inner=64, rotary_dim=4, n_ctx=4096,
    num_layers=2, d_model=32, n_layers=2, n_heads=4,
    partial_rotary_factor=0.5, rotary_emb_base=10000, rotary_pct=0.5,
    # granite / minicpm / hunyuan
    logits_scaling=1.0, attention_multiplier=0.125, embedding_multiplier=1.0,
    residual_multiplier=1.0, dim_model_base=32, scale_depth=1.0, scale_emb=1.0,
    use_qk_norm=True, use_cla=False, cla_share_factor=1,
)

OVER = {
    "lfm2": dict(num_hidden_layers=4, conv_bias=False, conv_L_cache=3, block_dim=32,
                 block_ff_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "phi": dict(partial_rotary_factor=0.5),
    "gemma3_text": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=8),
    "gemma2": dict(query_pre_attn_scalar=8, sliding_window=8),
    "deepseek_v3": dict(topk_method="noaux_tc"),
    "deepseek_v2": dict(topk_method="greedy", rope_scaling={
        "factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_v32": dict(q_lora_rank=16, index_head_dim=8, index_n_heads=2, index_topk=4),
    "deepseek_v41": dict(q_lora_rank=16, index_head_dim=8, index_n_heads=2, index_topk=4),
    "minicpm3": dict(q_lora_rank=16, dim_model_base=32, scale_depth=1.0, scale_emb=1.0,
                     rope_scaling={"type": "longrope", "long_factor": [1.0] * 4,
                                   "short_factor": [1.0] * 4,
                                   "original_max_position_embeddings": 4096}),
    "afmoe": dict(num_hidden_layers=4, num_dense_layers=1, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"] * 2, mup_enabled=False),
    "apertus": dict(post_norm=False, qk_norm=True),
    "cohere2": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2),
    "exaone4": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern="LLLG",
                    rope_scaling=None),
    "exaone_moe": dict(num_hidden_layers=4, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       is_moe_layer=[False, True, True, True]),
    "olmo3": dict(num_hidden_layers=4, sliding_window=8),
    "mellum": dict(num_hidden_layers=4, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 10000.0}}),
    "spark2_5": dict(num_hidden_layers=4, sliding_window=8,
                     rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                      "full_attention": {"rope_theta": 10000.0}}),
    "step3p5": dict(num_hidden_layers=4, num_attention_groups=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    moe_num_experts=4, moe_top_k=2, share_expert_dim=32, moe_layers_enum="1,3"),
    "gemma4_text": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
                        global_head_dim=16, vocab_size_per_layer_input=64,
                        hidden_size_per_layer_input=8, num_kv_shared_layers=0,
                        num_key_value_heads=1, tie_word_embeddings=True),
    "gemma4_text@shared": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
                        global_head_dim=16, vocab_size_per_layer_input=64,
                        hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                        num_key_value_heads=1, tie_word_embeddings=True),
    "glm4_moe": dict(topk_method="noaux_tc", partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(topk_method="noaux_tc", q_lora_rank=16),
    "solar_open": dict(topk_method="noaux_tc"),
    "llama4_text": dict(num_hidden_layers=4, intermediate_size_mlp=64, no_rope_layers=[1, 1, 1, 0],
                        use_qk_norm=True, attention_chunk_size=8, interleave_moe_layer_step=2,
                        num_experts_per_tok=1),
    "minimax": dict(shared_intermediate_size=32, rotary_dim=4),
    "ministral3": dict(num_hidden_layers=4, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                        "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 16}),
    "mistral4": dict(q_lora_rank=16,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                      "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 16}),
    "nemotron": dict(hidden_act="relu2"),
    # tests/test_unbatchable.py's families, and GPT-2
    "afm7": dict(vocab_size=64, hidden_dim=32, num_layers=4, num_kv_reuse_layers=2, num_heads=4,
                 num_kv_heads=2),
    "plamo3": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   sliding_window=8),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_inner=64, n_head=4),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=64,
                      gegelu_limit=20.0, mup_width_multiplier=1.0, mup_embedding_multiplier=1.0,
                      blocksparse_block_size=32, blocksparse_num_local_blocks=1,
                      blocksparse_vert_stride=2, num_hidden_layers=4),
    "phixtral": dict(num_vocab=64, model_dim=32, num_heads=4, num_layers=2, rotary_dim=4),
    "nemotron-nas": dict(block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}}],
        num_hidden_layers=4),
    "nemotron-nas@noop": dict(block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}}],
        num_hidden_layers=4),
    "nemotron-nas@linear": dict(block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 2.0}}],
        num_hidden_layers=2),
    "lille-130m": dict(n_embd=128, block_size=4096, n_kv_heads=2, tie_word_embeddings=False),
    "mimo_v2_flash": dict(num_hidden_layers=4, hybrid_layer_pattern=[0, 1, 1, 0],
                          moe_layer_freq=[0, 1, 1, 1], add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, sliding_window_size=8,
                          topk_method="noaux_tc", scoring_func="sigmoid", layernorm_epsilon=1e-5,
                          swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=8, swa_v_head_dim=8,
                          partial_rotary_factor=0.5),
    "glm_moe_dsa": dict(q_lora_rank=16, index_head_dim=8, index_n_heads=2, index_topk=4,
                        topk_method="noaux_tc", scoring_func="sigmoid",
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=64,
                          expert_ffn_hidden_size=32, zero_expert_num=2, q_lora_rank=16,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2,
                                q_lora_rank=16, mla_scale_q_lora=True, mla_scale_kv_lora=True,
                                ngram_vocab_size_ratio=2, emb_neighbor_num=2, emb_split_num=2),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(kv_channels=8, intermediate_size=128),
    "qwen3_5_moe": dict(num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.25}),

    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
                    use_cla=True, cla_share_factor=2, use_mixed_mlp_moe=True, num_hidden_layers=4),
    "openelm": dict(head_dim=8, num_transformer_layers=2, model_dim=32, ffn_dim_divisor=16,
                    num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[2.0, 2.0],
                    share_input_output_layers=False),
    "dbrx": dict(ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000.0}),
}
WRAP = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "kimi_k25": "deepseek_v3",
        "kimi_vl": "deepseek_v3", "lfm2-vl": "lfm2", "llama4": "llama4_text", "pixtral": "llama",
        "qwen3_vl_moe": "qwen3_moe", "mistral3": "llama", "muse_spark": "muse_spark",
        "minimax_m3_vl": "minimax_m3_vl", "gemma3n": "gemma3n"}
# families built by the project's own helpers (tests/families.py), window 8
FROM_FAMILIES = set()

MAX_PARAMS = 2_000_000
# matrices' scale where 3 (the tests' default) leaves the greedy reply near-constant
SCALE = {"gemma2": 1.0, "gemma4_text": 1.0, "gemma4_text@shared": 1.0, "gemma4": 1.0, "phi": 2.0}


def build(name, noise=0.0, seed=0):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from families import settled
    import families
    mx.random.seed(seed)
    if "+" in name or name in WRAP:  # a multimodal wrapper around a text model
        outer, inner = name.split("+") if "+" in name else (name, WRAP[name])
        module = importlib.import_module(f"mlx_lm.models.{outer}")
        text = dict(BASE, model_type=inner)
        text.update(OVER.get(inner, {}))
        text.update(OVER.get(name, {}))
        cfg = dict(model_type=outer, vocab_size=64, tie_word_embeddings=False, text_config=text)
        model = module.Model(module.ModelArgs.from_dict(cfg))
    elif name in FROM_FAMILIES or (name in families._BUILDERS and name not in OVER
                                 and name not in BASE_ONLY):
        model = families._BUILDERS[name](64, 8)
    else:
        module = importlib.import_module(f"mlx_lm.models.{name.split('@')[0]}")
        cfg = dict(BASE, model_type=name.split('@')[0])
        cfg.update(OVER.get(name, {}))
        model = module.Model(module.ModelArgs.from_dict(cfg))
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    if n > MAX_PARAMS:
        raise RuntimeError(f"config too big: {n} params")
    return settled(model, scale=SCALE.get(name, 3.0), noise=noise)

BASE_ONLY = set()  # families in families._BUILDERS to build from BASE instead


def short(e):
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s[:160]


def one(name):
    from families import plain_greedy
    res = {"family": name, "built": None}
    try:
        best = None
        for seed in range(4):  # the seed whose greedy reply is least degenerate
            target = build(name, seed=seed)
            want = plain_greedy(target, P, N)
            if best is None or len(set(want)) > best[0]:
                best = (len(set(want)), seed)
            if len(set(want)) >= 6:
                break
        seed = best[1]
        target = build(name, seed=seed)
        draft = build(name, noise=0.05, seed=seed)
        want = plain_greedy(target, P, N)
        want2 = plain_greedy(target, P2, N)
        res["seed"] = seed
        res["built"] = f"ok ({len(set(want))} distinct, seed {seed})"
    except Exception as e:
        res["built"] = "no: " + short(e)
        res["tb_build"] = traceback.format_exc()[-1500:]
        return res
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.batch import BatchEngine, RowRequest
    from mlx_spec.batch.kv import batchable
    from mlx_spec.tree_verify import positions_follow
    try:
        res["positions_follow"] = str(positions_follow(target))
    except Exception as e:
        res["positions_follow"] = "crash: " + short(e)

    def verdict(got, ref):
        if got == ref:
            return "ok"
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        return (f"WRONG (first diff at {i}; got {got[:i+3]} want {ref[:i+3]}; "
                f"len {len(got)}/{len(ref)})")

    def refused_or_crash(e):
        msg = str(e)
        if isinstance(e, ValueError) and msg.count("\n") == 0 and len(msg) < 400:
            return "refused: " + short(e)
        return "crash: " + short(e)

    # 1, 2: loop
    for key, tree in (("loop_chain", None), ("loop_tree", (3, 2))):
        try:
            kw = {} if tree is None else {"tree": tree}
            rounds = list(speculative_generate_step(P, target, draft, max_tokens=N,
                                                    num_draft_tokens=3, prompt_lookup=False, **kw))
            got = [t for r in rounds for t in r.tokens]
            v = verdict(got, want)
            acc = sum(r.num_accepted for r in rounds); dr = sum(r.num_drafted for r in rounds)
            if tree is not None:
                v += f" ({sum(1 for r in rounds if r.tree_nodes > 0)} tree rounds)"
            v += f" [acc {acc}/{dr}]"
            res[key] = v
        except Exception as e:
            res[key] = refused_or_crash(e)
            res["tb_" + key] = traceback.format_exc()[-2500:]

    # 3: batch
    try:
        b = batchable(target)
    except Exception as e:
        b = None
        res["batchable"] = "crash: " + short(e)
    else:
        res["batchable"] = str(b)
    for key, tree in (("batch_chain", None), ("batch_tree", (3, 2))):
        if not b:
            res[key] = "skipped (not batchable)"
            continue
        try:
            engine = BatchEngine(target, draft, num_draft_tokens=3, calibration=None, tree=tree)
            u1 = engine.insert(RowRequest(P, N, prompt_lookup=False))
            u2 = engine.insert(RowRequest(P2, N, prompt_lookup=False))
            out = {u1: [], u2: []}
            steps = 0
            while engine.busy:
                for o in engine.step():
                    out[o.uid] += o.tokens
                steps += 1
                if steps > 500:
                    raise RuntimeError("no progress after 500 steps")
            v1, v2 = verdict(out[u1], want), verdict(out[u2], want2)
            res[key] = "ok" if v1 == v2 == "ok" else f"row P: {v1}; row [1,2,3]: {v2}"
        except Exception as e:
            res[key] = refused_or_crash(e)
            res["tb_" + key] = traceback.format_exc()[-2500:]

    # 4: one at a time
    try:
        engine = BatchEngine(target, draft, max_rows=1, num_draft_tokens=3, calibration=None)
        pending = [(P, want), (P2, want2)]
        out, refs = {}, {}
        steps = 0
        while pending or engine.busy:
            if pending and engine.room > 0:
                p, w = pending.pop(0)
                u = engine.insert(RowRequest(p, N, prompt_lookup=False))
                out[u], refs[u] = [], w
            for o in engine.step():
                out[o.uid] += o.tokens
            steps += 1
            if steps > 500:
                raise RuntimeError("no progress after 500 steps")
        vs = [verdict(out[u], refs[u]) for u in out]
        res["solo"] = "ok" if all(v == "ok" for v in vs) else "; ".join(vs)
        res["solo_mode"] = str(engine.solo)
    except Exception as e:
        res["solo"] = refused_or_crash(e)
        res["tb_solo"] = traceback.format_exc()[-2500:]
    return res


COLS = ["built", "positions_follow", "loop_chain", "loop_tree", "batchable", "batch_chain",
        "batch_tree", "solo"]


def main(names, out: str, timeout=300):
    md, jsonl = RESULTS / f"{out}.md", RESULTS / f"{out}.jsonl"
    with open(md, "w") as f:
        f.write(f"# Every mlx-lm family through every path\n\n`python -m bench.studies."
                f"family_sweep --out {out}` at {commit()}, mlx-lm {mlx_lm_version()}, "
                f"{platform.machine()} CPU, {len(names)} families\n\n")
        f.write("| family | " + " | ".join(COLS) + " |\n")
        f.write("|" + "---|" * (len(COLS) + 1) + "\n")
    if jsonl.exists():
        jsonl.unlink()
    for name in names:
        t = time.time()
        try:
            p = subprocess.run([sys.executable, "-m", "bench.studies.family_sweep", "--one", name],
                               capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            line = [l for l in p.stdout.splitlines() if l.startswith("{")]
            if line:
                res = json.loads(line[-1])
            else:  # (the process died: its last words)
                last = p.stderr.strip().splitlines()[-1][:150] if p.stderr.strip() else "none"
                res = {"family": name, "built": f"crash: process rc {p.returncode}: {last}"}
        except subprocess.TimeoutExpired:
            res = {"family": name, "built": f"timeout after {timeout}s"}
        res["seconds"] = round(time.time() - t, 1)
        with open(jsonl, "a") as f:
            f.write(json.dumps(res) + "\n")
        with open(md, "a") as f:
            f.write(f"| {name} | " + " | ".join(str(res.get(c, "")).replace("|", "/")
                                               for c in COLS) + " |\n")
        print(name, res["seconds"], {c: res.get(c) for c in COLS}, flush=True)


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()


def mlx_lm_version() -> str:
    import mlx_lm
    return getattr(mlx_lm, "__version__", "?")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="mlx-lm families (default: FAMILIES)")
    parser.add_argument("--one", metavar="FAMILY", help="one family in this process: a JSON line")
    parser.add_argument("--out", default="family-sweep", help="bench/results/<out>.md, .jsonl")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)), flush=True)
    else:
        main(args.families or FAMILIES, args.out)
