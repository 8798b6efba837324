"""Variable-length multi-digit addition (the paper's Table 3 task), as text.

Surface formats (reference falcon-math.md §9.5; the choice is a config switch and is recorded with
every result):

- ``"paper"`` (default, Option A, closest to the paper's ``digits_n``): one width n per example shared
  by both operands, operands uniform in [0, 10^n) written with leading zeros, the sum written with
  n+1 digits, least-significant digit first::

      prompt  "0042 + 0917 ="          answer " 95900"      (42 + 917 = 959 -> 00959 reversed)

- ``"bracketed"`` (Option B, the authors' generator's surface form): the same sampling, every number
  reversed and bracketed::

      prompt  "[2400] + [7190] ="      answer " [95900]"

- ``"variable"`` (Option C, the authors' variable_digit generator): each operand gets its own width
  U{1..n_max} and no leading zeros (width 1 includes 0), the sum at its natural width, bracketed and
  all reversed. Evaluation sets at a width (OOD, :meth:`AdditionTask.fresh`) use exactly that many
  digits for both operands (ours).

Ours (not from the paper): the answer ends with the tokenizer's EOS token, which is scored like the
digits (``eos_in_answer``; the authors' code also puts the loss on its end token); so teacher-forced
exact match and free-running greedy exact match agree by construction.

In-distribution validation pairs are drawn up front from their own seed and removed from the
training stream (rejection). Ours: a width only holds pairs out when it has at least
``min_pairs_for_holdout`` operand pairs (default 10^5, so widths >= 3 with 10^6 pairs or more; see
:meth:`AdditionTask.heldout_widths`), so that holding out changes the training distribution by a
negligible fraction; smaller widths (1 and 2 by default) are validated on pairs the model may also
have trained on, and every report marks them ``held_out: false``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

FORMATS = ("paper", "bracketed", "variable")


@dataclass(frozen=True)
class AdditionExample:
    width: int
    a: int
    b: int
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def _rev(s: str) -> str:
    return s[::-1]


def format_example(a: int, b: int, width: int, fmt: str = "paper") -> AdditionExample:
    """Render one example. ``width`` is the shared operand width (for ``variable``: the sampling cap,
    kept only as a label)."""
    if fmt not in FORMATS:
        raise ValueError(f"addition format={fmt!r}: expected one of {FORMATS}")
    if a < 0 or b < 0:
        raise ValueError(f"addition operands must be non-negative, got a={a}, b={b}")
    c = a + b
    if fmt == "variable":
        return AdditionExample(width, a, b, f"[{_rev(str(a))}] + [{_rev(str(b))}] =",
                               f" [{_rev(str(c))}]")
    if a >= 10 ** width or b >= 10 ** width:
        raise ValueError(f"operands {a}, {b} do not fit width={width}")
    sa, sb, sc = f"{a:0{width}d}", f"{b:0{width}d}", f"{c:0{width + 1}d}"
    if fmt == "paper":
        return AdditionExample(width, a, b, f"{sa} + {sb} =", " " + _rev(sc))
    return AdditionExample(width, a, b, f"[{_rev(sa)}] + [{_rev(sb)}] =", f" [{_rev(sc)}]")


def parse_answer(answer: str, fmt: str = "paper") -> int | None:
    """Inverse of the answer rendering: the integer a generated answer denotes, or None."""
    s = answer.strip()
    if fmt in ("bracketed", "variable"):
        if not (s.startswith("[") and s.endswith("]")):
            return None
        s = s[1:-1]
    if not s.isdigit():
        return None
    return int(_rev(s))


def sample_operands(rng: random.Random, width: int, fmt: str = "paper",
                    exact: bool = False) -> tuple[int, int]:
    """Operands of one example. ``variable``: each operand's width ~ U{1..width} (the authors'
    training generator), or exactly ``width`` digits with ``exact`` (our evaluation at a width)."""
    if fmt == "variable":
        wa, wb = (width, width) if exact else (rng.randint(1, width), rng.randint(1, width))

        def draw(w):
            return rng.randrange(0, 10) if w == 1 else rng.randrange(10 ** (w - 1), 10 ** w)
        return draw(wa), draw(wb)
    return rng.randrange(10 ** width), rng.randrange(10 ** width)


def num_pairs(width: int, fmt: str = "paper") -> int:
    """How many distinct operand pairs a width can produce (every format: numbers below 10^width)."""
    return (10 ** width) ** 2


@dataclass
class AdditionTask:
    """Seeded generator of the three splits: the training stream (held-out pairs rejected), the
    in-distribution validation set (fixed, drawn up front) and fresh OOD evaluation sets."""

    train_widths: tuple[int, int] = (1, 32)
    ood_widths: tuple[int, int] = (33, 48)
    fmt: str = "paper"
    val_per_width: int = 32
    min_pairs_for_holdout: int = 100_000
    seed: int = 0
    _val: dict = field(default=None, init=False, repr=False)
    _held: set = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"addition format={self.fmt!r}: expected one of {FORMATS}")
        lo, hi = self.train_widths
        if not (1 <= lo <= hi):
            raise ValueError(f"train_widths={self.train_widths}: need 1 <= lo <= hi")
        olo, ohi = self.ood_widths
        if not (1 <= olo <= ohi):
            raise ValueError(f"ood_widths={self.ood_widths}: need 1 <= lo <= hi")
        if self.val_per_width < 1:
            raise ValueError(f"val_per_width={self.val_per_width}: must be >= 1")
        self.train_widths, self.ood_widths = (lo, hi), (olo, ohi)

    # -- validation (held out up front) ------------------------------------------------------
    def heldout_widths(self) -> list[int]:
        lo, hi = self.train_widths
        return [n for n in range(lo, hi + 1) if num_pairs(n, self.fmt) >= self.min_pairs_for_holdout]

    def _build_val(self):
        rng = random.Random(f"addition-val-{self.seed}-{self.fmt}")
        lo, hi = self.train_widths
        val, held = {}, set()
        hw = set(self.heldout_widths())
        for n in range(lo, hi + 1):
            pairs = []
            seen = set()
            # distinct pairs where the width has room for them
            want = min(self.val_per_width, num_pairs(n, self.fmt))
            while len(pairs) < want:
                p = sample_operands(rng, n, self.fmt)
                if p in seen:
                    continue
                seen.add(p)
                pairs.append(p)
            val[n] = [format_example(a, b, n, self.fmt) for a, b in pairs]
            if n in hw:
                held.update(self._key(n, a, b) for a, b in pairs)
        self._val, self._held = val, held

    def validation(self) -> dict[int, list[AdditionExample]]:
        """{width: examples}: the fixed in-distribution validation set."""
        if self._val is None:
            self._build_val()
        return self._val

    def _key(self, width: int, a: int, b: int):
        # the paper/bracketed text depends on the width (leading zeros); the variable format's text
        # is the same pair under every width cap, so its pairs are held out whatever the cap
        return (None, a, b) if self.fmt == "variable" else (width, a, b)

    def is_held_out(self, width: int, a: int, b: int) -> bool:
        if self._held is None:
            self._build_val()
        return self._key(width, a, b) in self._held

    # -- training stream ------------------------------------------------------------------------
    def train_example(self, index: int) -> AdditionExample:
        """Example ``index`` of the training stream: a pure function of (seed, index), so a resumed
        run sees the same data; held-out validation pairs are rejected and redrawn."""
        if self._held is None:
            self._build_val()
        rng = random.Random(f"addition-train-{self.seed}-{self.fmt}-{index}")
        lo, hi = self.train_widths
        n = rng.randint(lo, hi)
        while True:
            a, b = sample_operands(rng, n, self.fmt)
            if self._key(n, a, b) not in self._held:
                return format_example(a, b, n, self.fmt)

    # -- fresh evaluation sets ------------------------------------------------------------------
    def fresh(self, width: int, count: int = 100, tag: str = "ood", exact: bool = True) -> list[AdditionExample]:
        """``count`` fresh examples at ``width``, drawn independently (seeded by (seed, tag,
        width)); in the ``variable`` format both operands have exactly ``width`` digits (ours: the
        authors' generator only caps the width, which would make "width 48" mostly short numbers). At OOD widths training never produced such examples; at training widths they may
        coincide with training pairs (use :meth:`validation` for held-out pairs). ``exact=False`` (the
        ``variable`` format only) draws like the authors' generator with ``width`` as the cap: each
        operand's width ~ U{1..width}, so most examples at a cap of 33-48 are inside the training
        widths (the "capped" OOD split; see falcon_lab.evaluation.addition)."""
        rng = random.Random(f"addition-{tag}-{self.seed}-{self.fmt}-{width}")
        out = []
        while len(out) < count:
            a, b = sample_operands(rng, width, self.fmt, exact=exact)
            out.append(format_example(a, b, width, self.fmt))
        return out

    def ood(self, count: int = 100) -> dict[int, list[AdditionExample]]:
        lo, hi = self.ood_widths
        return {n: self.fresh(n, count, "ood") for n in range(lo, hi + 1)}

    def max_text_len(self) -> int:
        """Characters of the longest example over train and OOD widths (for sequence length)."""
        n = max(self.train_widths[1], self.ood_widths[1])
        ex = format_example(10 ** n - 1, 10 ** n - 1, n, "bracketed" if self.fmt != "paper" else "paper")
        return len(ex.text)
