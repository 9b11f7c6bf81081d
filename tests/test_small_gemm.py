"""SmallRowMatmul (ssd/models/small_gemm.py): same product as F.linear, orientation chosen by measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssd.models import small_gemm
from ssd.models.small_gemm import SmallRowMatmul, cold_copies, plain_product, transposed_product

BIG = small_gemm.MIN_WEIGHT_NUMEL


@pytest.mark.parametrize("transposed_seconds", [1.0, 3.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_choice_follows_the_measurement_and_the_product_is_the_same(transposed_seconds, with_bias):
    weight = torch.randn(BIG // 64, 64)
    bias = torch.randn(weight.shape[0]) if with_bias else None
    x = torch.randn(5, 64)
    calls = []

    def benchmark(product, x_, weights):
        calls.append(product)
        assert all(w.shape == weight.shape and torch.equal(w, weight) for w in weights)
        product(x_, weights[0])
        return transposed_seconds if product is transposed_product else 2.0

    matmul = SmallRowMatmul(benchmark)
    out = matmul(x, weight, bias)
    assert calls == [plain_product, transposed_product] * small_gemm.TRIALS  # interleaved
    key = (tuple(weight.shape), weight.dtype, 5, torch.get_num_threads())
    assert matmul.transposed == {key: transposed_seconds < 2.0}
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert out.is_contiguous() and out.shape == (5, weight.shape[0])
    torch.testing.assert_close(matmul(x, weight, bias), out)
    assert len(calls) == 2 * small_gemm.TRIALS  # measured once per (shape, row count)
    matmul(x, weight.clone())  # another weight of the same shape (another layer) reuses the choice
    assert len(calls) == 2 * small_gemm.TRIALS


def test_transposed_product_equals_linear():
    x, weight = torch.randn(7, 48), torch.randn(300, 48)
    torch.testing.assert_close(transposed_product(x, weight), F.linear(x, weight))


def test_near_ties_keep_the_plain_product():
    matmul = SmallRowMatmul(lambda product, x, ws: 1.0 if product is transposed_product else 1.1)  # < MARGIN
    matmul(torch.randn(3, 64), torch.randn(BIG // 64, 64))
    assert list(matmul.transposed.values()) == [False]


@pytest.mark.parametrize("rows, numel", [(1, BIG), (small_gemm.MAX_ROWS + 1, BIG), (4, BIG // 2)])
def test_outside_its_range_it_is_plain_linear_without_measuring(rows, numel):
    weight = torch.randn(numel // 64, 64)
    x = torch.randn(rows, 64)
    matmul = SmallRowMatmul(lambda *args: pytest.fail("must not measure"))
    assert torch.equal(matmul(x, weight), F.linear(x, weight))
    assert matmul.transposed == {}


def test_cold_copies_cover_the_cold_size_and_share_no_memory(monkeypatch):
    monkeypatch.setattr(small_gemm, "COLD_BYTES", 10_000)
    weight = torch.randn(10, 64)  # 2,560 bytes: 4 copies reach 10,000
    copies = cold_copies(weight)
    assert len(copies) == 4 and copies[0] is weight
    assert len({w.data_ptr() for w in copies}) == 4 and all(torch.equal(w, weight) for w in copies)
    big = torch.randn(100, 64)  # 25,600 bytes: cold on its own
    assert cold_copies(big) == [big]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v projections with a bias
def test_every_projection_of_a_model_uses_its_one_matmul(checkpoint_factory, arch, monkeypatch):
    from ssd.models.loader import load_model

    model, _ = load_model(checkpoint_factory(arch), dtype=torch.float32)
    projections = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(projections) == 4 * model.num_layers and all(m.matmul is model.matmul for m in projections)
    assert any(m.bias is not None for m in projections) == (arch == "qwen2")
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT_NUMEL", 0)  # tiny weights: measure them too
    model.matmul.benchmark = lambda product, x, ws: 1.0 if product is transposed_product else 2.0
    x = torch.randn(3, model.config.hidden_size)
    for m in projections:
        inp = x if m.in_features == x.shape[1] else torch.randn(3, m.in_features)
        torch.testing.assert_close(m(inp), F.linear(inp, m.weight, m.bias))
    assert model.matmul.transposed and all(model.matmul.transposed.values())
