"""Packed float16 weights (ssd/models/packed_fp16.py, weight_formats.py): the product, the formats' resolution,
a packed model, and every mode of an engine with a packed target (or a packed float16 or int8 draft) reproducing
that target's own greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from model_utils import PagedSession
from ssd import LLM, SamplingParams
from ssd.config import EngineConfig, SpeculativeConfig
from ssd.models import block_quant, weight_formats
from ssd.models.loader import load_model
from ssd.models.packed_fp16 import PackedFp16Product
from ssd.models.rowwise_int8 import has_vnni
from ssd.models.weight_formats import pack_weights, resolve_weight_format
from ssd.options import WeightFormat
from ssd.resolve import resolve_config
from ssd_utils import make_perturbed_draft

pytestmark = pytest.mark.skipif(not weight_formats.fbgemm_available(), reason="PyTorch built without FBGEMM")
# a draft's "auto" on this CPU
DRAFT_AUTO = (WeightFormat.Q8_0 if block_quant.available() and block_quant.vectorized()
              else WeightFormat.W8A8 if has_vnni() else WeightFormat.FP16_PACKED)


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_is_linear_with_float16_rounded_weights(rows, with_bias):
    weight = torch.randn(300, 96) * 0.1
    bias = torch.randn(300) if with_bias else None
    x = torch.randn(rows, 96)
    out = PackedFp16Product(weight)(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 300)
    torch.testing.assert_close(out, F.linear(x, weight.half().float(), bias), rtol=1e-5, atol=1e-5)
    assert not torch.equal(weight.half().float(), weight)  # the rounding is real: the check above is not vacuous


def test_weights_outside_the_float16_range_are_refused():
    weight = torch.ones(4, 8)
    weight[1, 2] = 1e5
    with pytest.raises(ValueError, match="float16 range"):
        PackedFp16Product(weight)


def test_resolution_of_formats():
    assert resolve_weight_format("auto", "cpu", "float32") == "fp16-packed"
    assert resolve_weight_format("auto", "cpu", "float32", draft=True) == DRAFT_AUTO
    assert resolve_weight_format("auto", "cpu", "bfloat16", draft=True) == "dense"
    assert resolve_weight_format("auto", "cpu", "bfloat16") == "dense"
    assert resolve_weight_format("auto", "cuda:0", "float32") == "dense"
    assert resolve_weight_format("dense", "cpu", "float32") == "dense"
    assert resolve_weight_format("fp16-packed", "cpu", "float32") == "fp16-packed"
    assert resolve_weight_format("auto", "cpu", "float32", explicit_dtype=True) == "dense"  # a target's named fp32
    assert resolve_weight_format("fp16-packed", "cpu", "float32", explicit_dtype=True) == "fp16-packed"
    for device, dtype in (("cuda", "float32"), ("cpu", "bfloat16")):
        with pytest.raises(ValueError, match="needs a CPU device, dtype float32"):
            resolve_weight_format("fp16-packed", device, dtype)
    with pytest.raises(ValueError, match="not supported"):
        resolve_weight_format("int4", "cpu", "float32")


def test_engine_config_defaults_and_validation():
    """What the engine starts from (``resolve_config``) for each request of dtype and formats."""
    auto = resolve_config(EngineConfig(model="t", dtype="auto", speculative_config={"model": "d"}))
    if auto.dtype == "float32":  # a CPU with FBGEMM: the fast reduced precision is float16 weights
        assert auto.weight_format == "fp16-packed"
    else:
        assert auto.weight_format == "dense"
    explicit = resolve_config(EngineConfig(model="t", dtype="float32", speculative_config={"model": "d"}))
    assert explicit.weight_format == "dense"  # an explicit float32 keeps float32 weights
    assert explicit.speculative_config.draft_weight_format == DRAFT_AUTO  # the draft's numerics are free
    dense_draft = resolve_config(EngineConfig(model="t", dtype="float32",
                                              speculative_config={"model": "d", "draft_weight_format": "dense"}))
    assert dense_draft.speculative_config.draft_weight_format == "dense"
    packed = resolve_config(EngineConfig(model="t", dtype="float32", weight_format="fp16-packed"))
    assert packed.weight_format == "fp16-packed"
    assert resolve_config(packed) == packed  # resolving twice changes nothing
    with pytest.raises(ValueError, match="weight format 'fp16' is not supported"):
        EngineConfig(model="t", weight_format="fp16")
    with pytest.raises(ValueError, match="draft_weight_format 'int8' is not supported"):
        SpeculativeConfig(model="d", draft_weight_format="int8")
    with pytest.raises(ValueError, match="needs a CPU device"):
        resolve_config(EngineConfig(model="t", dtype="bfloat16", weight_format="fp16-packed"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_packed_model_computes_the_float16_rounded_model(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    packed, _ = load_model(path, dtype=torch.float32)
    rounded, _ = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.half().float())
    # the head rounded on the fly: a tied input embedding stays float32 in both models
    rounded.head_matmul = lambda x, w, bias=None: F.linear(x, w.half().float(), bias)
    count = pack_weights(packed, WeightFormat.FP16_PACKED)
    assert count == 4 * packed.num_layers + 1
    assert all(m.weight.numel() == 0 for m in packed.modules() if isinstance(m, torch.nn.Linear))
    tokens = [random.Random(0).randrange(packed.config.vocab_size) for _ in range(11)]
    a = PagedSession(packed).step({0: tokens})[0]
    b = PagedSession(rounded).step({0: tokens})[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_packed_head_of_a_tied_model_keeps_the_embedding(checkpoint_factory):
    model, _ = load_model(checkpoint_factory("llama"), dtype=torch.float32)
    embedding = model.embed_tokens.weight.detach().clone()
    pack_weights(model, WeightFormat.FP16_PACKED)
    assert torch.equal(model.embed_tokens.weight, embedding)
    x = torch.randn(3, model.config.hidden_size)
    reference = F.linear(x, model.head_weight.half().float())
    torch.testing.assert_close(model.compute_logits(x)[:, : reference.shape[1]], reference, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair(checkpoint_factory, tmp_path_factory):
    target = checkpoint_factory("llama")
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("packed") / "draft", 0.02)
    return str(target), str(draft)


PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(4 + 3 * i)] for i in range(5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, block_size=8, seed=0)


def test_every_mode_with_a_packed_target_equals_its_autoregressive_decoding(pair):
    """The packed target is the model every mode runs: SD and SSD (packed drafts, the default) reproduce its
    greedy decoding exactly, while a dense target's tokens may differ in the last bits' near ties."""
    target, draft = pair
    with LLM(target, weight_format="fp16-packed", **ENGINE) as ar:
        assert ar.engine.runner.weight_format == "fp16-packed"
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3},
                 {"method": "ssd", "num_speculative_tokens": 3, "fallback": "jit"}):
        with LLM(target, weight_format="fp16-packed", speculative_config={"model": draft, **spec}, **ENGINE) as llm:
            outputs = llm.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outputs] == expected, spec["method"]
            assert llm.stats.num_accepted_tokens > 0


def test_a_packed_draft_leaves_a_dense_target_exact(pair):
    target, draft = pair
    with LLM(target, **ENGINE) as ar:
        assert ar.engine.runner.weight_format == "dense"
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    with LLM(target, speculative_config=spec, **ENGINE) as sd:
        assert sd.engine.proposer.runner.weight_format == DRAFT_AUTO
        assert [o.token_ids for o in sd.generate(PROMPTS, GREEDY)] == expected


def test_an_int8_draft_leaves_every_mode_exact(pair):
    target, draft = pair
    with LLM(target, **ENGINE) as ar:
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3},
                 {"method": "ssd", "num_speculative_tokens": 3, "fallback": "jit"}):
        config = {"model": draft, "draft_weight_format": WeightFormat.INT8_PACKED, **spec}
        with LLM(target, speculative_config=config, **ENGINE) as llm:
            outputs = llm.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outputs] == expected, spec["method"]
            assert llm.stats.num_accepted_tokens > 0
            if spec["method"] == "draft_model":
                assert llm.engine.proposer.runner.weight_format == WeightFormat.INT8_PACKED


def test_command_line_flags_reach_the_engine_config():
    import argparse

    from ssd.cli.common import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "t", "--draft", "d", "--weight-format", "dense",
                              "--draft-weight-format", "fp16-packed"])
    kwargs = engine_kwargs(args)
    assert kwargs["weight_format"] == "dense"
    assert kwargs["speculative_config"]["draft_weight_format"] == "fp16-packed"
    defaults = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d"]))
    assert defaults["weight_format"] == "auto" and defaults["speculative_config"]["draft_weight_format"] == "auto"
