"""Passkey retrieval: a number hidden at a chosen depth in long filler text (Mohtashami & Jaggi,
2023 style; our own wording and code).

    <filler ...> The pass key is 52917. Remember it. 52917 is the pass key. <filler ...>
    What is the pass key? The pass key is            -> answer " 52917"

``depth`` in [0, 1] places the key sentence at that fraction of the filler; the filler is repeated
(and cut on a sentence boundary) so the whole prompt has about ``context_len`` tokens under the
given tokenizer length function. Ours: the filler sentences, the 5-digit key, and the answer with a
leading space.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyExample:
    context_len: int
    depth: float
    key: str
    prompt: str
    answer: str


def make_passkey(context_len: int, depth: float, seed: int = 0,
                 length_fn: Callable[[str], int] = len, digits: int = 5) -> PasskeyExample:
    """One example whose prompt is at most ``context_len`` tokens (as measured by ``length_fn``,
    default characters = bytes for ASCII under a byte tokenizer)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth={depth}: must be in [0, 1]")
    rng = random.Random(f"passkey-{seed}-{context_len}-{depth}")
    key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    sentences = [s + ". " for s in FILLER.strip().rstrip(".").split(". ")]
    fixed = length_fn(needle + QUESTION)
    if fixed > context_len:
        raise ValueError(f"passkey context_len={context_len} is shorter than the needle and question "
                         f"({fixed} tokens)")
    filler: list[str] = []
    i = 0
    while True:
        cand = sentences[i % len(sentences)]
        if length_fn("".join(filler) + cand + needle + QUESTION) > context_len:
            break
        filler.append(cand)
        i += 1
    cut = round(depth * len(filler))
    prompt = "".join(filler[:cut]) + needle + "".join(filler[cut:]) + QUESTION
    return PasskeyExample(context_len, depth, key, prompt, " " + key)


def passkey_grid(context_lens, depths, per_cell: int = 5, seed: int = 0,
                 length_fn: Callable[[str], int] = len) -> list[PasskeyExample]:
    out = []
    for L in context_lens:
        for d in depths:
            for j in range(per_cell):
                out.append(make_passkey(int(L), float(d), seed=seed * 1000 + j, length_fn=length_fn))
    return out
