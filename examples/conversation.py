"""A conversation that reuses one prompt cache: each turn prefills only its new text.

    python examples/conversation.py

The cache holds the target's layers and the draft's. With
`prompt_cache_live=False` it is brought up to date when each turn's generator
ends or is closed (`closing` sees to that even when we stop early), with no
per-token upkeep; see "Reusing a prompt cache across turns" in docs/python-api.md.
"""

from contextlib import closing

from mlx_lm.models.cache import make_prompt_cache

from mlx_spec import load_default_pair, stream_generate

TURNS = [
    "def mean(values):\n",
    "\n\ndef median(values):\n",
    "\n\ndef mode(values):\n",
]

target_model, draft_model, tokenizer = load_default_pair()
cache = make_prompt_cache(target_model) + make_prompt_cache(draft_model)
for turn in TURNS:
    print(turn, end="")
    stream = stream_generate(target_model, tokenizer, turn, draft_model=draft_model,
                             prompt_cache=cache, prompt_cache_live=False, max_tokens=40)
    with closing(stream):
        for response in stream:
            print(response.text, end="", flush=True)
            if "\n\n" in response.text:  # stop at the end of the function, early
                break
    print(f"\n[{response.prompt_tokens} new prompt tokens prefilled, "
          f"{response.generation_tokens} generated at {response.generation_tps:.0f} tokens/s]")
