"""What a Falcon variant is, in one place: `FalconSpec.from_variant("3A")`.

Every other part of the platform (the op's prep and dispatch, the Triton cores' proven tables, the
mixer, the benchmarks) asks the spec instead of testing variant strings:

| variant | objective (delta) | per-value-column gates | sliding window |
|---|---|---|---|
| 1, 1A | regression / inner product | no | no |
| 2, 2A | regression / inner product | yes | no |
| 3, 3A | regression / inner product | no | yes (window B) |
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FalconSpec:
    variant: str
    delta: bool  # regression objective (1, 2, 3); False: inner product (1A, 2A, 3A)
    per_column: bool  # one gain and decay per value channel (2, 2A)
    windowed: bool  # sliding window of B pairs (3, 3A)

    @staticmethod
    def from_variant(variant) -> "FalconSpec":
        spec = SPECS.get(str(variant))
        if spec is None:
            raise ValueError(f"variant: unknown variant {variant!r}; expected one of {sorted(SPECS)}")
        return spec

    @staticmethod
    def from_flags(*, delta: bool, per_column: bool, windowed: bool) -> "FalconSpec":
        for spec in SPECS.values():
            if (spec.delta, spec.per_column, spec.windowed) == (bool(delta), bool(per_column), bool(windowed)):
                return spec
        raise ValueError(f"no Falcon variant has delta={delta}, per_column={per_column}, windowed={windowed}")

    def window(self, window: int) -> int:
        """The window the core runs with: B for 3/3A, 1 for the others."""
        return int(window) if self.windowed else 1

    @property
    def label(self) -> str:
        return f"Falcon-{self.variant}"

    def __iter__(self):  # tuple-compatible: `delta, per_column, windowed = VARIANTS[v]` keeps working
        return iter((self.delta, self.per_column, self.windowed))


SPECS: dict[str, FalconSpec] = {
    v: FalconSpec(v, delta=not v.endswith("A"), per_column=v[0] == "2", windowed=v[0] == "3")
    for v in ("1", "2", "3", "1A", "2A", "3A")
}
