"""SmallRowMatmul (ssd/models/small_gemm.py): same product as F.linear, orientation chosen by measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssd.models import small_gemm
from ssd.models.small_gemm import SmallRowMatmul, plain_product, transposed_product

BIG = small_gemm.MIN_WEIGHT_NUMEL


@pytest.mark.parametrize("transposed_seconds", [1.0, 3.0])
def test_choice_follows_the_measurement_and_the_product_is_the_same(transposed_seconds):
    weight = torch.randn(BIG // 64, 64)
    x = torch.randn(5, 64)
    calls = []

    def benchmark(product, x_, weight_):
        calls.append(product)
        product(x_, weight_)
        return transposed_seconds if product is transposed_product else 2.0

    matmul = SmallRowMatmul(benchmark)
    out = matmul(x, weight)
    assert calls == [plain_product, transposed_product] * small_gemm.TRIALS  # interleaved
    key = (tuple(weight.shape), weight.dtype, 5, torch.get_num_threads())
    assert matmul.transposed == {key: transposed_seconds < 2.0}
    torch.testing.assert_close(out, F.linear(x, weight))
    assert out.is_contiguous() and out.shape == (5, weight.shape[0])
    matmul(x, weight)
    assert len(calls) == 2 * small_gemm.TRIALS  # measured once per row count


def test_transposed_product_equals_linear():
    x, weight = torch.randn(7, 48), torch.randn(300, 48)
    torch.testing.assert_close(transposed_product(x, weight), F.linear(x, weight))


def test_near_ties_keep_the_plain_product():
    matmul = SmallRowMatmul(lambda product, x, w: 1.0 if product is transposed_product else 1.2)  # < MARGIN
    matmul(torch.randn(3, 64), torch.randn(BIG // 64, 64))
    assert list(matmul.transposed.values()) == [False]


@pytest.mark.parametrize("rows, numel", [(1, BIG), (small_gemm.MAX_ROWS + 1, BIG), (4, BIG // 2)])
def test_outside_its_range_it_is_plain_linear_without_measuring(rows, numel):
    weight = torch.randn(numel // 64, 64)
    x = torch.randn(rows, 64)
    matmul = SmallRowMatmul(lambda *args: pytest.fail("must not measure"))
    assert torch.equal(matmul(x, weight), F.linear(x, weight))
    assert matmul.transposed == {}
