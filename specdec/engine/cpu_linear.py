"""A model's linear layers on oneDNN with their weights packed once at load (CPU only).

Why: on a CPU, transformers' linear layers run aten's ``linear`` (MKL's sgemm on x86), which is
slow at the few rows a verify step brings, and speculation's premise, K + 1 tokens for about the
price of one, holds only with a GEMM that is efficient at a few rows
(docs/profiles.md#the-targets-linear-layers-on-a-cpu; ``scripts/profile_linear.py`` measures
it). vLLM's CPU backend does the same on x86 (its ``dispatch_cpu_unquantized_gemm`` packs each
unquantized linear weight for oneDNN at load).

The kernel is torch's own oneDNN linear, the one torch.compile's CPU freezing pass uses
(``torch.ops.mkldnn._reorder_linear_weight`` packs a weight into oneDNN's blocked layout,
``torch.ops.mkldnn._linear_pointwise`` runs it); no compilation, any number of rows.

Outputs differ from aten's by floating-point rounding only (another summation order; bounds in
docs/profiles.md#the-targets-linear-layers-on-a-cpu). Greedy output then equals plain
decoding except where the top two logits are within that rounding, the same kind of difference as a batched step's
(invariant *batch independence*, docs/architecture.md#invariants).

Small weights stay on aten (:data:`MIN_PACKED_ELEMENTS`): oneDNN's call costs a fixed 30-35 us
more than aten's (``scripts/profile_linear.py --layers``; 64 x 64 at one row: 35 us against 7 on
the AVX2 EPYC of docs/profiles.md#small-linear-layers-stay-on-aten), more than packing saves on a
layer of under 2^18 weights at any row count there; a near-free model's layers (hidden size 64)
ran 1.3-5x slower packed, from 320 rows to one.

Memory: each packed weight replaces the layer's own, so the model's size does not change, except
where a weight is shared (an LM head tied to the input embedding, as SmolLM2's): the embedding
keeps the original and the packed copy is extra (vocabulary x hidden x the dtype's bytes).
"""

import functools
import logging

import torch

log = logging.getLogger(__name__)
DTYPES = (torch.float32, torch.bfloat16)
MIN_PACKED_ELEMENTS = 2**18  # in_features x out_features; smaller layers stay on aten (module docstring)


def cpu_runs(dtype: torch.dtype) -> bool:
    """Whether this CPU runs oneDNN's packed linear in ``dtype`` (one of :data:`DTYPES`): float32 on
    any, bfloat16 only with the instructions oneDNN's bfloat16 path needs, AVX-512 BW, VL and DQ or
    AVX-NE-CONVERT (torch's ``mkldnn_bf16_device_check``, which packing a bfloat16 weight asserts:
    an AVX2-only CPU such as AMD's Zen 2 fails it)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of ``model``'s weights where they are on the CPU in one of :data:`DTYPES` and this
    torch is built with oneDNN; else None."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    return weight.dtype


def available(model: torch.nn.Module) -> bool:
    """Whether :func:`pack_linears` applies to ``model``: its weights on the CPU in float32 or
    bfloat16, this torch built with oneDNN, and this CPU able to run the weights' dtype there
    (:func:`cpu_runs`)."""
    dtype = _packable_dtype(model)
    return dtype is not None and cpu_runs(dtype)


@functools.cache
def _log_cpu_cannot(dtype: torch.dtype) -> None:
    """Says once per process and dtype that the linear layers stay on aten on this CPU."""
    name = str(dtype).removeprefix("torch.")
    log.warning(
        "the %s linear layers stay on aten's linear: this CPU (%s) lacks what oneDNN's %s path needs "
        "(AVX-512 BW/VL/DQ or AVX-NE-CONVERT); float32 weights would be packed",
        name,
        torch.backends.cpu.get_cpu_capability(),
        name,
    )


class PackedLinear(torch.nn.Module):
    """``torch.nn.Linear``'s forward over a weight packed for oneDNN: input ``[..., in_features]``,
    output ``[..., out_features]``, both of the weight's dtype. Inference only (no gradient)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replaces every ``torch.nn.Linear`` of ``model`` with at least ``min_elements`` weights
    (in_features x out_features) by a :class:`PackedLinear` of its weight, in place; returns how
    many. Does nothing (returns 0) where :func:`available` is False, and says so once (a warning)
    where only the CPU stands in the way."""
    dtype = _packable_dtype(model)
    if dtype is None:
        return 0
    if not cpu_runs(dtype):
        _log_cpu_cannot(dtype)
        return 0
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear) and child.in_features * child.out_features >= min_elements
    ]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return len(linears)
