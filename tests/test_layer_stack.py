"""All layers in one C++ call (ssd/models/layer_stack.py): the Python layers' bits in every kind of step, where
it applies and where not, clear errors, and engines whose targets and drafts run through it."""

from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.runtime.model_runner import ModelRunner
from ssd.models import cpu_fused, layer_stack
from ssd.models.loader import load_model
from ssd.models.weight_formats import pack_weights
from ssd.options import WeightFormat
from model_utils import PagedSession

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the CPU kernels could not be compiled")


def _model(path, weight_format: WeightFormat | None = WeightFormat.Q8_0, dtype=torch.float32):
    model, _ = load_model(path, dtype=dtype, device=torch.device("cpu"))
    if weight_format is not None:
        pack_weights(model, weight_format)
    model.enable_fused_kernels(kernels=cpu_fused)
    return model


# prompts of two sequences in chunks, then decode steps, a verification of 4 tokens beside a decode, a step of
# one sequence alone
STEPS = [{0: [5, 77, 301, 12, 9, 140, 33], 1: [8, 2]}, {1: [44, 45, 46, 47, 48]}, {0: [3], 1: [90]},
         {0: [11, 12, 13, 14], 1: [7]}, {1: [100, 101, 102]}, {0: [6], 1: [9]}]


@pytest.mark.parametrize("arch,weight_format,overrides", [
    ("llama", WeightFormat.Q8_0, {}),
    ("qwen2", WeightFormat.Q4_1, {}),  # q/k/v biases
    ("qwen3", WeightFormat.Q4_0, {}),  # per-head q/k norms
    ("llama", WeightFormat.Q8_0, {"num_heads": 8}),  # head size 8: the attention's scalar path
])
def test_the_stack_gives_the_python_layers_bits(checkpoint_factory, arch, weight_format, overrides):
    model = _model(checkpoint_factory(arch=arch, num_layers=3, **overrides), weight_format)
    stack = model.layer_stack
    assert stack is not None and stack.num_layers == 3
    sessions = {name: PagedSession(model, row_invariant=True) for name in ("stack", "python")}
    for i, step in enumerate(STEPS):
        layers = ((0, 2, 1), (), (1,))[i % 3]  # an EAGLE-3 head's features, in any order, or none
        logits = {}
        for name, session in sessions.items():
            model.layer_stack = stack if name == "stack" else None
            logits[name] = session.step(step, layers)
        for seq in step:
            assert torch.equal(logits["stack"][seq], logits["python"][seq])
        if layers:
            assert sessions["stack"].features.shape == (sum(map(len, step.values())), len(layers) * 64)
            assert torch.equal(sessions["stack"].features, sessions["python"].features)
        else:
            assert sessions["stack"].features is None and sessions["python"].features is None
    for name in ("stack", "python"):  # and the caches they wrote
        for mine, theirs in zip(sessions[name].caches, sessions["python"].caches):
            assert torch.equal(mine.key, theirs.key) and torch.equal(mine.value, theirs.value)


def test_steps_without_row_invariant_attention_run_the_python_layers(checkpoint_factory, monkeypatch):
    model = _model(checkpoint_factory(arch="llama"))
    assert model.layer_stack is not None

    def refuse(*args, **kwargs):
        raise AssertionError("the layer stack ran a step whose attention is not row-invariant")

    monkeypatch.setattr(model.layer_stack, "forward", refuse)
    PagedSession(model, row_invariant=False).step({0: [1, 2, 3]})  # SDPA, through the Python layers


def test_where_the_stack_does_not_apply(checkpoint_factory):
    path = checkpoint_factory(arch="llama")
    dense = _model(path, weight_format=None)
    assert dense.layer_stack is None
    assert "not block-quantized" in layer_stack.unsupported(dense)
    half = _model(path, weight_format=None, dtype=torch.bfloat16)
    assert "bfloat16" in layer_stack.unsupported(half)
    mixed = _model(path)  # one projection in another format
    mixed.layers[1].mlp.down_proj.matmul = torch.nn.functional.linear
    assert layer_stack.unsupported(mixed) == "layer 1's down_proj is not block-quantized"
    assert layer_stack.build_layer_stack(mixed) is None
    assert layer_stack.unsupported(_model(path)) is None


def test_clear_error_for_the_wrong_caches(checkpoint_factory):
    model = _model(checkpoint_factory(arch="llama", num_layers=2))
    session = PagedSession(model, row_invariant=True)
    session.caches = session.caches[:1]
    with pytest.raises(ValueError, match="expected 2 KV caches"):
        session.step({0: [1, 2]})
    caches = model.allocate_kv_caches(2, 4)
    args = (torch.zeros(1, 64), torch.ones(1, 1, 8), torch.zeros(1, 1, 8))
    steps = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
             None)
    with pytest.raises(RuntimeError, match="expected 2 key and value caches, got 1"):
        model.layer_stack._stack.forward(*args, [caches[0].key], [], *steps, [])
    with pytest.raises(RuntimeError, match=r"feature layer 2 is not in \[0, 2\)"):
        model.layer_stack._stack.forward(*args, [c.key for c in caches], [c.value for c in caches], *steps, [0, 2])


def test_block_format_runners_take_row_invariant_attention_and_the_stack(checkpoint_factory):
    path = str(checkpoint_factory(arch="llama"))
    for weight_format, expected in ((WeightFormat.Q8_0, True), (WeightFormat.DENSE, False)):
        runner = ModelRunner(path, "float32", "cpu", 4, 256, None, 0.5, num_blocks=16, weight_format=weight_format)
        assert runner.row_invariant_attention is expected
        assert (runner.model.layer_stack is not None) is expected


def test_engines_decode_the_same_tokens_with_and_without_the_stack(checkpoint_factory, monkeypatch):
    """A q8_0 target and a q8_0 draft (SD and SSD): their layers run in the stack, and every token equals the
    Python layers'."""
    target = str(checkpoint_factory(arch="llama", num_layers=2))
    draft = str(checkpoint_factory(arch="llama", num_layers=1, seed=3))
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"model": draft, "num_speculative_tokens": 3, "draft_weight_format": "q8_0"}
    outputs = {}
    for stacked in (True, False):
        if not stacked:
            monkeypatch.setattr(cpu_fused, "layer_stack", lambda model: None)
        for method in ("draft_model", "ssd"):
            with LLM(target, weight_format="q8_0", speculative_config={**spec, "method": method}) as llm:
                assert (llm.engine.runner.model.layer_stack is not None) is stacked
                if method == "draft_model":  # in this process (SSD's draft runs in its own)
                    assert (llm.engine.proposer.runner.model.layer_stack is not None) is stacked
                outputs[stacked, method] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True, "draft_model"] == outputs[False, "draft_model"] == outputs[True, "ssd"]
    assert outputs[False, "ssd"] == outputs[True, "ssd"]
