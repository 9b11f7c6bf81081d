"""Block-quantized products (weight formats q8_0 / q4_0, ssd/models/block_quant.py and its C++ kernel): against
a float64 reference, bitwise batch invariance, the portable path against the vector one, quantization round
trips, GGUF blocks read bit for bit against the gguf package's own dequantization, and models in these formats
decoding the same tokens in every mode."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from ssd.models.row_attention import available as row_attention_available
from ssd.models import block_quant
from ssd.models.block_quant import (
    BlockKind,
    BlockQuantProduct,
    blocks_from_gguf,
    quantize_blocks,
)
from ssd.models.loader import load_model
from ssd.models.weight_formats import pack_weights, resolve_weight_format
from ssd.options import WeightFormat
from gguf_utils import random_q4_k
from ssd_utils import assert_every_mode_decodes_like_ar, make_perturbed_draft

pytestmark = pytest.mark.skipif(not block_quant.available(), reason="the block-quantized kernel could not be compiled")

KINDS = [kind for kind in BlockKind if kind is not BlockKind.Q4_K]  # with a quantizer here (Q4_K: files only)
GGUF_TYPES = {kind: gguf.GGMLQuantizationType[kind.name] for kind in KINDS}
# Relative error of the product against the float one: ~1% (8-bit) and ~10% (4-bit) of its norm.
QUANTIZATION_ERROR = {BlockKind.Q8_0: 0.02, BlockKind.Q4_0: 0.15, BlockKind.Q4_1: 0.15}


def _activations(x: torch.Tensor) -> torch.Tensor:
    """Float64 activations as the kernel quantizes them: per row, per block of 32, ``round(x / s) * s``."""
    rows, k = x.shape
    padded = torch.zeros(rows, -(-k // 64) * 64, dtype=torch.float64)
    padded[:, :k] = x.double()
    blocks = padded.view(rows, -1, 32)
    scale = (blocks.abs().amax(dim=-1, keepdim=True).float() / 127.0).double()
    q = torch.where(scale > 0, torch.round((blocks.float() * torch.where(scale > 0, 1 / scale.float(), 0)).double()), 0)
    return (q * scale).view(rows, -1)[:, :k]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), [(5, 32), (24, 96), (70, 200), (64, 576)])
def test_matches_a_float64_reference(kind, out_features, in_features):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(9, in_features, generator=gen)
    product = BlockQuantProduct(weight, kind)
    exact = _activations(x) @ quantize_blocks(weight, kind).dequantize()[:, :in_features].double().T
    out = product(x)
    assert out.shape == (9, out_features) and out.dtype == torch.float32
    # The only rounding left is float32 accumulation (and activation rounding ties): ~1e-6 of the magnitude.
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())
    full = x.double() @ weight.double().T  # against the float product, the quantization error itself
    assert (out.double() - full).norm() / full.norm() < QUANTIZATION_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_alone_and_beside_any_companions(kind):
    gen = torch.Generator().manual_seed(1)
    product = BlockQuantProduct(torch.randn(36, 160, generator=gen), kind)
    row = torch.randn(1, 160, generator=gen)
    alone = product(row)
    for companions in range(1, 32):
        others = torch.randn(companions, 160, generator=gen) * (companions % 5 + 0.5)
        for position in {0, companions // 2, companions}:
            batch = torch.cat([others[:position], row, others[position:]])
            assert torch.equal(product(batch)[position], alone[0]), (companions, position)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 12, 13, 25])  # one pass, one of 12, passes of 7 + 6, 9 + 8 + 8
def test_the_portable_path_gives_the_vector_paths_bits(kind, rows):
    gen = torch.Generator().manual_seed(2)
    product = BlockQuantProduct(torch.randn(44, 300, generator=gen), kind)
    x = torch.randn(rows, 300, generator=gen)
    assert torch.equal(product(x), product(x, portable=True))


def test_threads_do_not_change_the_bits():
    gen = torch.Generator().manual_seed(3)
    product = BlockQuantProduct(torch.randn(200, 128, generator=gen), BlockKind.Q4_0)
    x = torch.randn(6, 128, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x)
        torch.set_num_threads(2)
        two = product(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kind", KINDS)
def test_quantization_round_trip(kind):
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(4))
    weight[3] = 0.0  # a block of zeros: scale 0, values 0
    blocks = quantize_blocks(weight, kind)
    values, scales = blocks.values, blocks.scales
    assert values.shape == (16, 128) and scales.shape == (16, 4) and scales.dtype == torch.float16
    low, high = {BlockKind.Q8_0: (-127, 127), BlockKind.Q4_0: (-8, 7), BlockKind.Q4_1: (0, 15)}[kind]
    assert low <= int(values.min()) and int(values.max()) <= high
    assert not values[:, 96:].any() and not scales[:, 3:].any() and not values[3].any()
    assert (blocks.mins is not None) == kind.has_min
    back = blocks.dequantize()[:, :96]
    step = scales[:, :3].float().abs().repeat_interleave(32, dim=1)
    # Half a step (and the float16 scale's and minimum's rounding); q4_0's range -8..7 is one-sided, so a value
    # at the far end from the block's extreme (mapped to -8) may clamp at 7: a full step there.
    bound = step * (1.0 if kind is BlockKind.Q4_0 else 0.5) + 2e-3 * weight.abs().amax(dim=1, keepdim=True)
    assert ((back - weight).abs() <= bound).all()
    assert torch.equal(quantize_blocks(back, kind).dequantize()[:, :96], back)  # dequantized weights: a fixed point


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_features", [64, 96, 576])
def test_gguf_blocks_are_read_bit_for_bit(kind, in_features):
    weight = np.random.default_rng(5).standard_normal((12, in_features)).astype(np.float32)
    raw = quants.quantize(weight, GGUF_TYPES[kind])  # the gguf package's own quantization
    reference = quants.dequantize(raw, GGUF_TYPES[kind])
    blocks = blocks_from_gguf(torch.from_numpy(raw), kind, in_features)
    assert torch.equal(blocks.dequantize()[:, :in_features], torch.from_numpy(reference))
    ours = quantize_blocks(torch.from_numpy(weight), kind)  # our quantizer makes the gguf package's blocks
    assert torch.equal(ours.values, blocks.values) and torch.equal(ours.scales, blocks.scales)
    assert ours.mins is None if blocks.mins is None else torch.equal(ours.mins, blocks.mins)
    product = BlockQuantProduct.from_blocks(blocks, kind, in_features)
    x = torch.randn(3, in_features)
    torch.testing.assert_close(product(x).double(), _activations(x) @ torch.from_numpy(reference).double().T,
                               rtol=1e-4, atol=1e-3)


def test_clear_errors():
    with pytest.raises(ValueError, match="2-D CPU tensor"):
        BlockQuantProduct(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="whole blocks"):
        blocks_from_gguf(torch.zeros(2, 34, dtype=torch.uint8), BlockKind.Q8_0, 40)
    with pytest.raises(ValueError, match="take 34 bytes"):
        blocks_from_gguf(torch.zeros(2, 18, dtype=torch.uint8), BlockKind.Q8_0, 32)
    q4_0 = quantize_blocks(torch.randn(4, 64), BlockKind.Q4_0)
    with pytest.raises(ValueError, match="q4_1 blocks need minimums"):
        BlockQuantProduct.from_blocks(q4_0, BlockKind.Q4_1, 64)
    with pytest.raises(ValueError, match="CPU device"):
        resolve_weight_format("q4_0", "cuda", "float16")


def test_pack_weights_holds_a_q4_0_model_in_under_40_percent_of_its_float16_bytes(checkpoint_factory):
    model, _ = load_model(checkpoint_factory("llama"), dtype=torch.float32)
    float16_bytes = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    float16_bytes += 2 * model.head_weight.numel()
    pack_weights(model, WeightFormat.Q4_0)
    products = [m.matmul for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "matmul")]
    assert {p.kind for p in products} == {BlockKind.Q4_0} and model.head_matmul.kind is BlockKind.Q8_0
    # Projections in 4.5 bits per weight (and padding); the head, in 8.5, is the largest matrix of this tiny
    # model, so count the projections alone for the 40% bound the format is for.
    projection_float16 = float16_bytes - 2 * model.head_weight.numel()
    assert sum(p.nbytes for p in products) < 0.4 * projection_float16


ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, block_size=8, seed=0)


@pytest.mark.skipif(not row_attention_available(), reason="the row-invariant attention kernel could not be compiled")
@pytest.mark.parametrize(("target_format", "draft_format"), [("q4_0", "q8_0"), ("q8_0", "q4_0"), ("q4_1", "q4_1")])
def test_every_mode_and_batch_shape_of_a_block_quantized_target_decodes_the_same(
        checkpoint_factory, tmp_path, target_format, draft_format):
    target = str(checkpoint_factory("llama"))
    draft = str(make_perturbed_draft(target, tmp_path / "draft", 0.02))
    assert_every_mode_decodes_like_ar(target, draft, {**ENGINE, "weight_format": target_format}, draft_format,
                                      ngram_k=2)


@pytest.mark.parametrize(("out_features", "in_features"), [(5, 256), (40, 512)])
def test_q4_k_blocks_read_bit_for_bit_and_multiply_like_the_reference(out_features, in_features):
    """Q4_K (GGUF files only): super-blocks of 256 with 6-bit block scales and minimums read bit for bit
    against the gguf package; the product against float64, the portable path against the vector one, and a
    row's bits alone and beside companions."""
    raw = random_q4_k(out_features, in_features, seed=7)
    blocks = blocks_from_gguf(torch.from_numpy(raw), BlockKind.Q4_K, in_features)
    reference = quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
    product = BlockQuantProduct.from_blocks(blocks, BlockKind.Q4_K, in_features)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, in_features, generator=gen)
    exact = _activations(x) @ torch.from_numpy(reference).double().T
    torch.testing.assert_close(product(x).double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())
    assert torch.equal(product(x, portable=True), product(x))
    alone = product(x[4:5])
    for companions in (1, 6, 17):
        batch = torch.cat([torch.randn(companions, in_features, generator=gen), x[4:5]])
        assert torch.equal(product(batch)[-1], alone[0])
    with pytest.raises(ValueError, match="no quantizer"):
        BlockQuantProduct(torch.randn(4, 256), BlockKind.Q4_K)
    with pytest.raises(ValueError, match="blocks of 256"):
        blocks_from_gguf(torch.from_numpy(raw), BlockKind.Q4_K, 128)
