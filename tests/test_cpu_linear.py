"""The target's linear layers on oneDNN (:mod:`specdec.engine.cpu_linear`): the same outputs as
``torch.nn.Linear`` up to rounding, for any number of rows, only layers of at least
``MIN_PACKED_ELEMENTS`` weights packed by default, and a model whose every linear layer is packed
computes the same logits. bfloat16 packs only on a CPU that runs oneDNN's bfloat16 path:
each test of it checks the choice made on the host it runs on (an AVX2-only CPU takes the other
branch; ``qemu-x86_64 -cpu EPYC-Rome`` plays one on an AVX-512 host)."""

import copy
import logging

import pytest
import torch

from specdec.engine import cpu_linear
from specdec.engine.cpu_linear import PackedLinear, available, cpu_runs, pack_linears
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (9, 48), (64, 48), (1, 5, 48), (2, 3, 48)])
def test_packed_linear_equals_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected, out = linear(x), PackedLinear(linear)(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)


def bfloat16_runs_here() -> bool:
    """torch's own answer, the one packing a bfloat16 weight asserts (``mkldnn_bf16_device_check``)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_packed_linear_in_bfloat16_where_the_cpu_runs_it():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    assert cpu_runs(torch.bfloat16) == bfloat16_runs_here()
    if not bfloat16_runs_here():  # an AVX2-only CPU: the pack would fail, which is why cpu_runs is asked
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            PackedLinear(linear)
        return
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, out = linear(x).float(), PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, atol=0.05, rtol=0.02)


def test_pack_linears_in_bfloat16_packs_where_the_cpu_runs_it_else_says_so_once(caplog):
    model = tiny_llama(seed=0).to(torch.bfloat16)
    packed = copy.deepcopy(model)
    cpu_linear._log_cpu_cannot.cache_clear()
    with caplog.at_level(logging.WARNING, logger=cpu_linear.__name__):
        num_packed = [pack_linears(packed, min_elements=0), pack_linears(copy.deepcopy(model), min_elements=0)]
    warnings = [r.getMessage() for r in caplog.records if r.name == cpu_linear.__name__]
    if bfloat16_runs_here():
        assert num_packed[0] == num_packed[1] == 2 * 7 + 1 and warnings == []
    else:
        assert num_packed == [0, 0] and len(warnings) == 1 and "AVX-512 BW/VL/DQ" in warnings[0]
        assert any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.inference_mode():
        expected, logits = model(ids).logits.float(), packed(ids).logits.float()
    assert torch.allclose(logits, expected, atol=0.1, rtol=0.05)


def test_pack_linears_packs_only_layers_of_at_least_min_elements_weights():
    """The tiny model's LM head (49,152 x 64 weights) is packed; its layers' (at most 128 x 64)
    stay on aten, unless the bound is lowered."""
    model = tiny_llama(seed=0)
    assert pack_linears(model) == 1
    assert isinstance(model.lm_head, PackedLinear)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 2 * 7  # q, k, v, o, gate, up, down
    assert pack_linears(model, min_elements=0) == 2 * 7
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_pack_linears_keeps_the_logits():
    model = tiny_llama(seed=0)
    packed = copy.deepcopy(model)
    num_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(packed, min_elements=0) == num_linears == 2 * 7 + 1  # 7 a layer; the head
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.inference_mode():
        expected, logits = model(ids).logits, packed(ids).logits
    assert torch.allclose(logits, expected, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_pack_linears_leaves_what_it_cannot_run():
    half = tiny_llama(seed=0).to(torch.float16)
    assert not available(half)
    assert pack_linears(half) == 0
    assert any(isinstance(m, torch.nn.Linear) for m in half.modules())
