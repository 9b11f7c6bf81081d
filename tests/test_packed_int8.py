"""int8 draft weights (ssd/models/packed_int8.py): the product, where the format is allowed, and a packed model
(SD and SSD with an int8 draft are checked beside the packed float16 ones in test_packed_fp16.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.models import weight_formats
from ssd.models.loader import load_model
from ssd.models.weight_formats import pack_weights, resolve_weight_format
from ssd.options import WeightFormat
from ssd.resolve import resolve_config
from ssd.models.packed_fp16 import PackedFp16Product
from ssd.models.packed_int8 import PackedInt8Product

pytestmark = pytest.mark.skipif(not weight_formats.fbgemm_available(), reason="PyTorch built without FBGEMM")


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_approximates_the_float_product(rows, with_bias):
    """8-bit weights per row and 7-bit inputs: close to the float32 product (a relative error of a few
    percent at most), and not equal to it (the quantization is real)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 96, generator=gen) * 0.1
    weight[7] *= 50  # a row with its own range: per-row scales keep the others fine
    bias = torch.randn(300, generator=gen) if with_bias else None
    x = torch.randn(rows, 96, generator=gen)
    out = PackedInt8Product(weight)(x, weight, bias)
    expected = F.linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 300)
    error = (out - expected).norm() / expected.norm()
    assert 0 < error < 0.03
    rows_error = (out - expected)[:, :7].norm() / expected[:, :7].norm()  # the big row did not coarsen the others
    assert rows_error < 0.03


def test_zero_weights_and_inputs_are_exact():
    weight = torch.zeros(5, 8)
    weight[1] = 1.0
    out = PackedInt8Product(weight)(torch.zeros(2, 8))
    assert torch.equal(out, torch.zeros(2, 5))


def test_int8_is_a_draft_format_only():
    assert resolve_weight_format(WeightFormat.INT8_PACKED, "cpu", "float32", draft=True) == WeightFormat.INT8_PACKED
    with pytest.raises(ValueError, match="not supported"):
        resolve_weight_format(WeightFormat.INT8_PACKED, "cpu", "float32")
    with pytest.raises(ValueError, match="needs a CPU device, dtype float32"):
        resolve_weight_format(WeightFormat.INT8_PACKED, "cpu", "bfloat16", draft=True)
    spec = {"model": "d", "draft_weight_format": WeightFormat.INT8_PACKED}
    config = resolve_config(EngineConfig(model="t", dtype="float32", speculative_config=spec))
    assert config.speculative_config.draft_weight_format == WeightFormat.INT8_PACKED
    assert SpeculativeConfig(model="d", draft_weight_format=WeightFormat.INT8_PACKED).draft_weight_format == WeightFormat.INT8_PACKED
    with pytest.raises(ValueError, match="weight format 'int8-packed' is not supported"):
        EngineConfig(model="t", dtype="float32", weight_format=WeightFormat.INT8_PACKED)


def test_packed_model_stays_close_to_the_float_model(checkpoint_factory):
    """int8 for the attention and gate/up projections; the down projection and the head stay float16."""
    path = checkpoint_factory("llama")
    packed, _ = load_model(path, dtype=torch.float32)
    dense, _ = load_model(path, dtype=torch.float32)
    assert pack_weights(packed, WeightFormat.INT8_PACKED) == 4 * packed.num_layers + 1
    kinds = {name.rsplit(".", 1)[-1]: type(m.matmul) for name, m in packed.named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert kinds == {"qkv_proj": PackedInt8Product, "o_proj": PackedInt8Product, "gate_up_proj": PackedInt8Product,
                     "down_proj": PackedFp16Product}
    assert isinstance(packed.head_matmul, PackedFp16Product)
    x = torch.randn(4, packed.config.hidden_size)
    a, b = packed.compute_logits(x), dense.compute_logits(x)
    assert 0 < float((a - b).norm() / b.norm()) < 0.03
