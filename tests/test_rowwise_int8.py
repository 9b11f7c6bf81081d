"""The ``"w8a8"`` format (ssd/models/rowwise_int8.py): the product against a float64 reference, its batch
invariance (a row's result bitwise independent of its companions and its position), and a w8a8 draft leaving
every mode exact."""

from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.models import weight_formats
from ssd.models.loader import load_model
from ssd.models.packed_fp16 import PackedFp16Product
from ssd.models.packed_int8 import PackedInt8Product
from ssd.models.rowwise_int8 import RowwiseInt8Product, activation_levels, quantize_per_channel
from ssd.models.weight_formats import pack_weights
from ssd.options import WeightFormat
from ssd_utils import make_perturbed_draft

pytestmark = pytest.mark.skipif(not weight_formats.fbgemm_available(), reason="PyTorch built without FBGEMM")


def _reference(x: torch.Tensor, weight: torch.Tensor, levels: int) -> torch.Tensor:
    """The same quantized arithmetic in float64: per-channel int8 weights, per-row activations."""
    w = quantize_per_channel(weight).dequantize().double()  # [out, in]
    x = x.double()
    scale = x.abs().amax(dim=1, keepdim=True) / levels
    return (torch.round(x / scale) * scale) @ w.T


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 48), (5, 576, 960), (16, 1536, 576)])
def test_matches_the_float64_reference_of_its_quantization(rows, in_features, out_features):
    torch.manual_seed(0)
    weight, x = torch.randn(out_features, in_features) * 0.05, torch.randn(rows, in_features)
    product = RowwiseInt8Product(weight)
    out = product(x)
    expected = _reference(x, weight, activation_levels()[0])
    # exact integer products; only the float32 scaling of the int32 sums rounds
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    exact = x.double() @ weight.double().T
    relative = (out.double() - exact).norm() / exact.norm()
    assert relative < (0.02 if activation_levels()[0] == 127 else 0.04)  # the quantization's own error


def test_a_row_is_bitwise_the_same_whatever_shares_the_product():
    torch.manual_seed(1)
    weight = torch.randn(320, 1536) * 0.05
    product = RowwiseInt8Product(weight)
    row = torch.randn(1, 1536) * 3.0
    alone = product(row)
    for companions in range(1, 32):
        others = torch.randn(companions, 1536) * torch.rand(companions, 1) * 10  # rows of other magnitudes
        for position in {0, companions // 2, companions}:
            batch = torch.cat([others[:position], row, others[position:]])
            assert torch.equal(product(batch)[position], alone[0]), (companions, position)


def test_bias_leading_dimensions_and_zero_rows():
    torch.manual_seed(2)
    weight, bias = torch.randn(24, 32), torch.randn(24)
    product = RowwiseInt8Product(weight)
    x = torch.randn(2, 3, 32)
    out = product(x, None, bias)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.reshape(6, 24), product(x.reshape(6, 32)) + bias)
    assert torch.equal(product(torch.zeros(2, 32)), torch.zeros(2, 24))


def test_refuses_weights_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D CPU tensor"):
        RowwiseInt8Product(torch.zeros(2, 3, 4))


def test_pack_weights_puts_every_matrix_of_a_w8a8_model_in_int8(checkpoint_factory):
    model, _ = load_model(checkpoint_factory("llama"), dtype=torch.float32)
    count = pack_weights(model, WeightFormat.W8A8)
    products = [m.matmul for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "matmul")]
    assert count == len(products) + 1 and all(isinstance(p, RowwiseInt8Product) for p in products)
    assert isinstance(model.head_matmul, RowwiseInt8Product)
    draft, _ = load_model(checkpoint_factory("llama"), dtype=torch.float32)
    pack_weights(draft, WeightFormat.INT8_PACKED)  # the draft-only mix keeps float16 for down and the head
    assert isinstance(draft.head_matmul, PackedFp16Product)
    assert {type(m.matmul) for m in draft.modules() if hasattr(m, "matmul") and isinstance(m, torch.nn.Linear)} \
        == {PackedInt8Product, PackedFp16Product}


PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(4 + 3 * i)] for i in range(5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, block_size=8, seed=0)


def test_a_w8a8_draft_leaves_every_mode_exact(checkpoint_factory, tmp_path):
    target = str(checkpoint_factory("llama"))
    draft = str(make_perturbed_draft(target, tmp_path / "draft", 0.02))
    with LLM(target, weight_format="fp16-packed", **ENGINE) as ar:
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3},
                 {"method": "ssd", "num_speculative_tokens": 3, "fallback": "jit"}):
        config = {"model": draft, "draft_weight_format": "w8a8", **spec}
        with LLM(target, weight_format="fp16-packed", speculative_config=config, **ENGINE) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected, spec["method"]
            assert llm.stats.num_accepted_tokens > 0
            if spec["method"] == "draft_model":
                assert llm.engine.proposer.runner.weight_format == WeightFormat.W8A8
