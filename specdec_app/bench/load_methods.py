"""The methods of ``specdec bench concurrency`` by name, and the ratios its reports give.

- ``pipeline/adaptive``: the pipeline, the coordinator choosing K every round;
- ``pipeline/K=<n>``, n in 0..:data:`MAX_K`: the pipeline at a fixed K (``K=0``: plain decode
  through the same batched verify service), so that adaptive K can be read against the best fixed
  K of each cell;
- ``transformers-serve``: ``transformers serve --continuous-batching`` on the same target.

A name may carry a suffix after ``@`` (the network setting a pipeline method ran under,
:mod:`specdec_app.bench.network`); :func:`base_method` drops it.
"""

import re

ADAPTIVE, PIPELINE_K0, PIPELINE_K4, SERVE = "pipeline/adaptive", "pipeline/K=0", "pipeline/K=4", "transformers-serve"
METHODS = (ADAPTIVE, PIPELINE_K0, SERVE)  # the real-model run's default; --ceiling has its own
MAX_K = 16
# tokens/s ratios reported per N, (numerator, denominator), where both methods ran
RATIOS = (
    (ADAPTIVE, PIPELINE_K0),
    (PIPELINE_K4, PIPELINE_K0),
    (ADAPTIVE, SERVE),
    (PIPELINE_K0, SERVE),
    (PIPELINE_K4, SERVE),
)
_FIXED_K = re.compile(r"pipeline/K=(\d+)")


def fixed_k(k: int) -> str:
    """The name of the pipeline at fixed K ``k``."""
    return f"pipeline/K={k}"


def base_method(name: str) -> str:
    """``name`` without its ``@...`` suffix."""
    return name.partition("@")[0]


def requested_k(name: str) -> int | None:
    """The K a pipeline method's requests ask for: None for ``pipeline/adaptive``. Raises
    ValueError for a name that is not a pipeline method or a K outside 0..MAX_K."""
    base = base_method(name)
    if base == ADAPTIVE:
        return None
    match = _FIXED_K.fullmatch(base)
    if match is None or int(match[1]) > MAX_K or match[1] != str(int(match[1])):
        raise ValueError(f"{name!r} is not a pipeline method: use {ADAPTIVE} or pipeline/K=<n>, n in 0..{MAX_K}")
    return int(match[1])


def is_fixed_k(name: str) -> bool:
    """Whether ``name`` is a ``pipeline/K=<n>`` method."""
    try:
        return requested_k(name) is not None
    except ValueError:
        return False


def method_order(name: str) -> tuple[int, int, str]:
    """Sort key of the reports' method order: adaptive, then the fixed Ks by K, then transformers
    serve; a suffix after the base name's (its network setting) keeps the run's order of
    suffixes as given by the caller's stable sort."""
    base = base_method(name)
    if base == ADAPTIVE:
        return (0, 0, base)
    if is_fixed_k(base):
        return (1, requested_k(base) or 0, base)
    return (2, 0, base)


def parse_methods(spec: str) -> list[str]:
    """``pipeline/K=8,transformers-serve,pipeline/K=2`` as a list in :func:`method_order`, each
    once. Raises ValueError naming the choices."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    allowed = [ADAPTIVE, f"pipeline/K=<n> (n in 0..{MAX_K})", SERVE]
    unknown = [n for n in names if not (is_fixed_k(n) or n in (SERVE, ADAPTIVE)) or "@" in n]
    if not names or unknown:
        raise ValueError(f"--methods {spec!r}: use a comma-separated subset of {', '.join(allowed)}")
    return sorted(dict.fromkeys(names), key=method_order)


def ratio_pairs(names: list[str]) -> list[list[str]]:
    """The pairs of :data:`RATIOS` among the methods ``names`` (numerator, denominator): under a
    network each pipeline method against its counterpart under the same setting (the name's
    suffix) or a method run under none (transformers serve)."""
    suffix = {name: name[len(base_method(name)) :] for name in names}
    return [
        [a, b]
        for numerator, denominator in RATIOS
        for a in names
        if base_method(a) == numerator
        for b in names
        if base_method(b) == denominator and suffix[b] in ("", suffix[a])
    ]


def best_fixed_k(tokens_per_second: dict[str, float | None]) -> str | None:
    """Of the ``pipeline/K=<n>`` methods of ``tokens_per_second`` (method -> its tokens/s in one
    cell), the one with the most tokens/s (the smaller K on a tie); None without one."""
    fixed = [(value, -(requested_k(m) or 0), m) for m, value in tokens_per_second.items() if is_fixed_k(m) and value]
    return max(fixed)[2] if fixed else None
