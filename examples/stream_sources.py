"""Stream tokens and show where each came from: draft model, prompt lookup or the target.

    python examples/stream_sources.py
"""

from mlx_spec import load_default_pair, stream_generate

MARK = {"draft": "\x1b[32m", "lookup": "\x1b[36m", "target": ""}

target_model, draft_model, tokenizer = load_default_pair()
prompt = (
    "def area(width, height):\n    return width * height\n\n"
    "# the same function, renamed to surface\n"
)
response = None
for response in stream_generate(target_model, tokenizer, prompt, draft_model=draft_model,
                                max_tokens=80, prompt_lookup=True, temp=0.7, seed=0):
    print(MARK[response.source] + response.text + "\x1b[0m", end="", flush=True)
print()
print(response.stats.summary())
