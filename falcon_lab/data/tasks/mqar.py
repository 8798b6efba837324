"""Multi-query associative recall (MQAR), in the style of Zoology (Arora et al., 2023); our own code.

A sequence of ``seq_len`` token ids::

    k1 v1 k2 v2 ... kN vN | f f k3 v3 f k1 v1 f ...
    \\____ N pairs ______/   \\__ query region: each key of the pairs once, followed by its value

Keys are drawn without replacement from ``key_ids``, values (with replacement) from ``value_ids``;
the query region repeats every key once at a random position (each followed by its value) and is
padded with the filler id. The model is scored on predicting the value right after each queried
key (one target per key): ``targets[i] = value`` at the query key's position ``i``, ``-100``
elsewhere. Position convention: ``targets[i]`` is the token to predict *from* position ``i``
(i.e. ``input_ids[i + 1]``).

Ours (Zoology differs in detail): token ids come straight from the model's vocabulary (default
keys 1..127, values 128..255, filler 0: byte ids, so any byte-level model can run it), the query
positions are uniform rather than power-law spaced, and every key is queried exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MQARSpec:
    num_kv_pairs: int
    seq_len: int
    key_ids: tuple[int, int] = (1, 128)  # [lo, hi)
    value_ids: tuple[int, int] = (128, 256)
    filler_id: int = 0

    def validate(self):
        klo, khi = self.key_ids
        vlo, vhi = self.value_ids
        if self.num_kv_pairs < 1:
            raise ValueError(f"mqar num_kv_pairs={self.num_kv_pairs}: must be >= 1")
        if khi - klo < self.num_kv_pairs:
            raise ValueError(f"mqar num_kv_pairs={self.num_kv_pairs} exceeds the {khi - klo} key ids "
                             f"in key_ids={self.key_ids}")
        if vhi <= vlo:
            raise ValueError(f"mqar value_ids={self.value_ids}: empty range")
        if max(klo, khi) > vlo and min(khi, vhi) > max(klo, vlo):
            raise ValueError(f"mqar key_ids={self.key_ids} and value_ids={self.value_ids} overlap")
        if klo <= self.filler_id < khi or vlo <= self.filler_id < vhi:
            raise ValueError(f"mqar filler_id={self.filler_id} lies inside the key or value ids")
        if self.seq_len < 4 * self.num_kv_pairs:
            raise ValueError(f"mqar seq_len={self.seq_len} must be >= 4 * num_kv_pairs "
                             f"= {4 * self.num_kv_pairs} (pairs plus one query per key)")


def make_mqar(spec: MQARSpec, num_examples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Returns {"input_ids": [N, T] long, "targets": [N, T] long (-100 = not scored)}."""
    spec.validate()
    n, T = spec.num_kv_pairs, spec.seq_len
    g = torch.Generator().manual_seed(seed)
    klo, khi = spec.key_ids
    vlo, vhi = spec.value_ids
    keys = torch.stack([torch.randperm(khi - klo, generator=g)[:n] for _ in range(num_examples)]) + klo
    values = torch.randint(vlo, vhi, (num_examples, n), generator=g)
    ids = torch.full((num_examples, T), spec.filler_id, dtype=torch.long)
    tgt = torch.full((num_examples, T), -100, dtype=torch.long)
    ids[:, 0:2 * n:2] = keys
    ids[:, 1:2 * n:2] = values
    # query region: [2n, T); choose n non-overlapping slots of width 2 (key, value)
    region = T - 2 * n
    slots = region // 2
    for e in range(num_examples):
        chosen = torch.randperm(slots, generator=g)[:n]
        order = torch.randperm(n, generator=g)
        pos = 2 * n + 2 * chosen  # slot starts
        ids[e, pos] = keys[e, order]
        ids[e, pos + 1] = values[e, order]
        tgt[e, pos] = values[e, order]
    return {"input_ids": ids, "targets": tgt}


def recover_answers(input_ids: torch.Tensor, num_kv_pairs: int, targets: torch.Tensor) -> bool:
    """Check the construction: for every scored position, the queried key occurs exactly once in
    the pair section and the value stored after it is the target. Returns True when all hold."""
    for row, trow in zip(input_ids.tolist(), targets.tolist()):
        pairs = row[:2 * num_kv_pairs]
        kv = {}
        for k, v in zip(pairs[0::2], pairs[1::2]):
            if k in kv:
                return False
            kv[k] = v
        for i, t in enumerate(trow):
            if t == -100:
                continue
            if kv.get(row[i]) != t or row[i + 1] != t:
                return False
    return True
