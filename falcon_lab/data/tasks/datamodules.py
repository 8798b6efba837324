"""Lightning datamodules for the synthetic tasks, ``data.name: addition`` and ``data.name: mqar``
(named in :mod:`falcon_lab.data.registry`). Batches follow the platform's convention:
{"input_ids" [B, T], "labels" [B, T]} with labels already shifted (``labels[:, t]`` is the token
after ``input_ids[:, t]``) and -100 where no loss is taken.

Training order is a pure function of (seed, global example index), and the loader starts at the
trainer's global step, so a resumed run continues with the examples an uninterrupted run would
have seen (ours, like the LM datamodule).
"""
from __future__ import annotations

import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from falcon_lab.data.lm import StepDataLoader
from falcon_lab.data.tasks.addition import AdditionTask
from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar
from falcon_lab.data.tokenizer import build_tokenizer

IGNORE = -100


def _get(cfg, key, default=None):
    v = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if v is None else v


def _check_keys(cfg, allowed: set, section: str):
    keys = set(cfg.keys()) if hasattr(cfg, "keys") else set()
    unknown = sorted(keys - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


class _Indexed(Dataset):
    """Virtual dataset: item i = make(i)."""

    def __init__(self, make, n):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(int(i))


class _StepSampler(Sampler):
    """Batches of consecutive global example indices, starting at a global batch, rank-strided."""

    def __init__(self, batch_size, start_batch, total_batches, rank=0, world=1):
        self.bs, self.start, self.total, self.rank, self.world = batch_size, start_batch, total_batches, rank, world

    def __len__(self):
        # the run's one Lightning epoch, not what is left of it: resuming, Lightning counts on from its
        # restored in-epoch counter (= start), see falcon_lab.data.lm.StepBatchSampler (issue 16)
        return max(0, self.total)

    def __iter__(self):
        for b in range(self.start, self.total):
            first = (b * self.world + self.rank) * self.bs
            yield list(range(first, first + self.bs))


def pad_collate(pad_id: int):
    def collate(items):
        T = max(len(x) for x, _ in items)
        ids = torch.full((len(items), T), pad_id, dtype=torch.long)
        lab = torch.full((len(items), T), IGNORE, dtype=torch.long)
        for r, (x, y) in enumerate(items):
            ids[r, :len(x)] = torch.tensor(x)
            lab[r, :len(y)] = torch.tensor(y)
        return {"input_ids": ids, "labels": lab}
    return collate


class _TaskDataModule(L.LightningDataModule):
    def _train_loader(self, make):
        start, rank, world, total = 0, 0, 1, 10 ** 9
        if self.trainer is not None:
            accum = int(self.trainer.accumulate_grad_batches)
            start = int(self.trainer.global_step) * accum
            rank, world = int(self.trainer.global_rank), int(self.trainer.world_size)
            if self.trainer.max_steps and self.trainer.max_steps > 0:
                total = int(self.trainer.max_steps) * accum
        sampler = _StepSampler(self.batch_size, start, total, rank, world)
        return StepDataLoader(_Indexed(make, 10 ** 12), batch_sampler=sampler, collate_fn=self.collate,
                              num_workers=self.num_workers)


class AdditionDataModule(_TaskDataModule):
    """Variable-length addition (see :mod:`falcon_lab.data.tasks.addition`). Each example is
    ``[BOS] prompt answer [EOS]`` with loss on the answer and EOS only. Validation batches are the
    held-out in-distribution set (the loss on it; accuracy comes from the AdditionEvalCallback)."""

    KEYS = {"name", "format", "train_widths", "ood_widths", "val_per_width", "min_pairs_for_holdout",
            "seed", "batch_size", "val_batch_size", "tokenizer", "eos_in_answer", "num_workers",
            "seq_len", "global_batch_size"}  # global_batch_size: the trainer's (train.yaml)

    def __init__(self, cfg, seed: int = 0):
        super().__init__()
        _check_keys(cfg, self.KEYS, "data (addition)")
        self.cfg = cfg
        self.task = AdditionTask(train_widths=tuple(_get(cfg, "train_widths", (1, 32))),
                                 ood_widths=tuple(_get(cfg, "ood_widths", (33, 48))),
                                 fmt=str(_get(cfg, "format", "paper")),
                                 val_per_width=int(_get(cfg, "val_per_width", 32)),
                                 min_pairs_for_holdout=int(_get(cfg, "min_pairs_for_holdout", 100_000)),
                                 seed=int(_get(cfg, "seed", seed)))
        self.tokenizer = build_tokenizer(_get(cfg, "tokenizer", "byte"))
        self.eos_in_answer = bool(_get(cfg, "eos_in_answer", True))
        self.batch_size = int(_get(cfg, "batch_size", 64))
        self.val_batch_size = int(_get(cfg, "val_batch_size", self.batch_size))
        self.num_workers = int(_get(cfg, "num_workers", 0))
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size}: must be >= 1")
        self.collate = pad_collate(self.tokenizer.pad_id)
        # longest example in tokens (BOS + prompt + answer + EOS - 1 inputs): what models must hold
        need = self.task.max_text_len() + 2
        given = _get(cfg, "seq_len", None)
        if given is not None and int(given) < need:
            raise ValueError(f"data.seq_len={given} is shorter than the longest addition example "
                             f"({need} tokens at width {max(self.task.ood_widths[1], self.task.train_widths[1])})")
        self.seq_len = int(given) if given is not None else need

    def encode(self, ex):
        tok = self.tokenizer
        p = [tok.bos_id] + tok.encode(ex.prompt)
        a = tok.encode(ex.answer) + ([tok.eos_id] if self.eos_in_answer else [])
        seq = p + a
        labels = [IGNORE] * (len(p) - 1) + a
        return seq[:-1], labels

    def train_dataloader(self):
        return self._train_loader(lambda i: self.encode(self.task.train_example(i)))

    def val_dataloader(self):
        exs = [ex for n, v in sorted(self.task.validation().items()) for ex in v]
        return DataLoader([self.encode(e) for e in exs], batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=self.collate)


class MQARDataModule(_TaskDataModule):
    """Multi-query associative recall (see :mod:`falcon_lab.data.tasks.mqar`). Training examples
    mix ``num_kv_pairs`` (a list: one drawn per example) at ``seq_len``; validation is a fixed set
    of ``val_examples`` per entry of ``num_kv_pairs``. Token ids are byte ids, so the byte tokenizer
    (or any vocabulary >= 256) works."""

    KEYS = {"name", "num_kv_pairs", "seq_len", "seed", "batch_size", "val_batch_size", "val_examples",
            "tokenizer", "key_ids", "value_ids", "filler_id", "num_workers", "global_batch_size"}

    def __init__(self, cfg, seed: int = 0):
        super().__init__()
        _check_keys(cfg, self.KEYS, "data (mqar)")
        self.cfg = cfg
        nkv = _get(cfg, "num_kv_pairs", [4, 8, 16])
        self.num_kv_pairs = [int(nkv)] if isinstance(nkv, int) else [int(x) for x in nkv]
        self.seq_len = int(_get(cfg, "seq_len", 128))
        self.seed = int(_get(cfg, "seed", seed))
        self.tokenizer = build_tokenizer(_get(cfg, "tokenizer", "byte"))
        self.batch_size = int(_get(cfg, "batch_size", 64))
        self.val_batch_size = int(_get(cfg, "val_batch_size", self.batch_size))
        self.val_examples = int(_get(cfg, "val_examples", 64))
        self.num_workers = int(_get(cfg, "num_workers", 0))
        self.key_ids = tuple(_get(cfg, "key_ids", (1, 128)))
        self.value_ids = tuple(_get(cfg, "value_ids", (128, 256)))
        self.filler_id = int(_get(cfg, "filler_id", 0))
        if max(self.value_ids) > self.tokenizer.vocab_size:
            raise ValueError(f"data.value_ids={self.value_ids} exceed the tokenizer's vocab "
                             f"({self.tokenizer.vocab_size})")
        for n in self.num_kv_pairs:  # fail at start-up, naming the key
            try:
                self.spec(n).validate()
            except ValueError as e:
                raise ValueError(f"data.num_kv_pairs / data.seq_len: {e}") from None
        self.collate = pad_collate(self.tokenizer.pad_id)

    def spec(self, n):
        return MQARSpec(n, self.seq_len, self.key_ids, self.value_ids, self.filler_id)

    def _item(self, d, r=0):
        ids, tgt = d["input_ids"][r].tolist(), d["targets"][r].tolist()
        return ids, tgt

    def train_dataloader(self):
        def make(i):
            n = random.Random(f"mqar-{self.seed}-{i}").choice(self.num_kv_pairs)
            return self._item(make_mqar(self.spec(n), 1, seed=(1 << 40) + (self.seed << 32) + i))  # disjoint from eval seeds
        return self._train_loader(make)

    def val_dataloader(self):
        items = []
        for n in self.num_kv_pairs:
            d = make_mqar(self.spec(n), self.val_examples, seed=10_000_019 + self.seed * 131 + n)
            items += [self._item(d, r) for r in range(self.val_examples)]
        return DataLoader(items, batch_size=self.val_batch_size, shuffle=False, collate_fn=self.collate)
