"""Hand-built models whose log-probabilities are known in closed form, for checking evaluators
(and a minimal byte tokenizer to pair with them). They follow the evaluation model protocol of
:mod:`falcon_lab.evaluation.common`.
"""
from __future__ import annotations

import torch
from torch import nn


class ToyByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class BigramLM(nn.Module):
    """logits[t] = table[input_ids[t]]: p(next | prefix) depends on the last token only."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)

    @property
    def vocab_size(self):
        return self.table.shape[0]

    def forward(self, input_ids):
        return self.table[input_ids]

    def init_state(self, batch, device=None):
        return None

    def step(self, tokens, state):
        return self.table[tokens], state

    def logprob(self, prev: int, nxt: int) -> float:
        return float(torch.log_softmax(self.table[prev].double(), -1)[nxt])


class PrefixSumLM(nn.Module):
    """logits[t] = table[(sum of input_ids[..t]) mod V]: depends on the whole prefix, so a decoder
    that mishandles recurrent state or padding gives different answers. State = running sum."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)

    def forward(self, input_ids):
        V = self.table.shape[0]
        return self.table[torch.cumsum(input_ids, dim=1) % V]

    def init_state(self, batch, device=None):
        return torch.zeros(batch, dtype=torch.long, device=self.table.device)

    def step(self, tokens, state):
        state = state + tokens
        return self.table[state % self.table.shape[0]], state

    def state_numel(self, batch_size=1, seq_len=None):
        return batch_size


def cycle_table(text: str, vocab_size: int = 259, sharp: float = 20.0) -> torch.Tensor:
    """A bigram table whose greedy continuation cycles through ``text`` (byte ids): after byte
    text[i] the argmax is text[i+1] (wrapping around). Characters must be distinct."""
    ids = list(text.encode())
    if len(set(ids)) != len(ids):
        raise ValueError("cycle_table: characters must be distinct")
    table = torch.zeros(vocab_size, vocab_size)
    for i, a in enumerate(ids):
        table[a, ids[(i + 1) % len(ids)]] = sharp
    table[256, ids[0]] = sharp  # after BOS start the cycle
    return table


class LookupLM(nn.Module):
    """Predicts ``table[prefix]`` (a dict from a tuple of token ids to the next id) with certainty,
    and a uniform distribution (argmax = id 0) for unknown prefixes: an exactly specified model for
    checking exact-match scoring and decoding on hand-built cases. State = the prefix so far."""

    def __init__(self, table: dict, vocab_size: int = 259, sharp: float = 30.0):
        super().__init__()
        self.next = dict(table)
        self.vocab_size, self.sharp = vocab_size, sharp
        self.register_buffer("_dev", torch.zeros(0))

    @staticmethod
    def from_sequences(seqs, vocab_size: int = 259) -> "LookupLM":
        """Teach it to continue each prefix of each sequence with the sequence's next token."""
        table = {}
        for s in seqs:
            s = list(s)
            for t in range(1, len(s)):
                table[tuple(s[:t])] = s[t]
        return LookupLM(table, vocab_size)

    def _row(self, prefix):
        out = torch.zeros(self.vocab_size)
        nxt = self.next.get(tuple(prefix))
        if nxt is not None:
            out[nxt] = self.sharp
        return out

    def forward(self, input_ids):
        ids = input_ids.tolist()
        return torch.stack([torch.stack([self._row(r[:t + 1]) for t in range(len(r))]) for r in ids]).to(
            self._dev.device)

    def init_state(self, batch, device=None):
        return [[] for _ in range(batch)]

    def step(self, tokens, state):
        state = [s + [int(t)] for s, t in zip(state, tokens.tolist())]
        return torch.stack([self._row(s) for s in state]).to(self._dev.device), state
