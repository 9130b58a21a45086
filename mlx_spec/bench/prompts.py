"""The fixed prompt set: code to complete, text to copy or edit, free prose.

Acceptance depends on the kind of text: copying is easy to draft, prose is
hard, code sits in between. The shipped default models are trained on Python
standard-library code, so code prompts come first and carry the headline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class Prompt:
    kind: str  # "code", "copy" or "prose"
    name: str
    text: str


PROMPTS: Tuple[Prompt, ...] = (
    Prompt("code", "fibonacci",
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    Prompt("code", "class_init",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
           "    def push(self, item):\n"),
    Prompt("code", "parse_args",
           "import argparse\n\n\ndef parse_args(argv=None):\n"
           '    parser = argparse.ArgumentParser(description="Copy files.")\n'),
    Prompt("copy", "rename",
           "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n"
           "# The same function, renamed to load_settings:\ndef load_settings(path):\n"),
    Prompt("copy", "repeat_list",
           "NAMES = ['alpha', 'beta', 'gamma', 'delta', 'epsilon']\n"
           "# Repeat NAMES in upper case:\nUPPER_NAMES = ['ALPHA', "),
    Prompt("prose", "story", "Once upon a time, in a small village by the sea, there lived"),
    Prompt("prose", "explain", "Speculative decoding speeds up language models because"),
)

QUICK_PROMPTS: Tuple[Prompt, ...] = (PROMPTS[0], PROMPTS[3], PROMPTS[5])


def encode_prompts(tokenizer, prompts=PROMPTS) -> List[Tuple[Prompt, List[int]]]:
    """Token ids for each prompt, as the generator sees them."""
    encoded = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt.text)
        if len(ids) < 2:
            raise ValueError(f"Prompt {prompt.name!r} encodes to fewer than 2 tokens.")
        encoded.append((prompt, list(ids)))
    return encoded
