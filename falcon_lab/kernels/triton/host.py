"""Host-side helpers for the kernel launchers (ours): the integer helpers and the environment switches (read once at
import, each recorded in SWITCHES). Triton 3.6's `triton.cdiv` and
`triton.next_power_of_2` are ConstexprFunctions: called from Python each costs ~12 us (2-core CPU,
2026-12-02: 18 such calls made ~220 us of a Falcon-1A forward+backward's host time), and the eager ops are
bound by their host time on the H200 at small shapes (benchmarks/results/h200_logs/kernels_2026-12-02e/)."""


import os


# Every FALCON_TRITON_* environment switch the kernels read, as it was read (ours): name -> dict(value, default,
# choices or None, what). Filled at import by env_choice / env_value; `python -m falcon_lab.bench switches` prints it.
SWITCHES: dict = {}


def env_value(name: str, default: str, what: str, choices: tuple = None) -> str:
    """The raw value of the switch `name` (read once, at import; the caller checks free-form values), recorded in
    SWITCHES with `what` it decides."""
    value = os.environ.get(name, default)
    SWITCHES[name] = dict(value=value, default=default, choices=tuple(choices) if choices else None, what=what)
    return value


def env_choice(name: str, default: str, choices: tuple, what: str = "") -> str:
    """The value of the switch `name` (read once, at import), one of `choices`; anything else fails at start-up,
    naming the variable and what it takes."""
    value = env_value(name, default, what, choices)
    if value not in choices:
        quoted = [repr(c) for c in choices]
        allowed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


# Kernel paths not yet proven on the H200 run on CUDA only with FALCON_TRITON_UNPROVEN=1 (read once, here).
UNPROVEN = env_choice("FALCON_TRITON_UNPROVEN", "0", ("0", "1"),
                      "1: run kernel paths not yet proven on the H200 on CUDA too") == "1"


def refuse_unproven(device, setting: str, proven: str) -> None:
    """Refuse a kernel path not yet proven on the H200 on CUDA unless FALCON_TRITON_UNPROVEN=1 (CPU tensors run it under
    the interpreter): `setting` is the switch as set ("VAR=value"), `proven` the value that is."""
    if device.type == "cuda" and not UNPROVEN:
        raise RuntimeError(f"{setting} is not yet proven on the H200; it runs on CUDA only with "
                           f"FALCON_TRITON_UNPROVEN=1 ({proven} is proven)")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b (what triton.cdiv computes)."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (what triton.next_power_of_2 computes)."""
    return 1 << max(int(n) - 1, 0).bit_length()
