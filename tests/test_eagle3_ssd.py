"""SSD with an EAGLE-3 head (``method="ssd"`` with a head's folder as ``model``) is exact.

The draft worker runs the head (``ssd/speculative/async_draft/head_engine.py``); each round the target sends it the
features of the positions it verified. Greedy tokens equal plain autoregressive decoding of the target with the
test pairs of ``test_eagle3_sd.py`` (a random head: almost every draft rejected, so rounds are served by the
fallbacks and by the cache's recovery branches; an agreeing head: every draft accepted, so rounds hit the cache's
bonus branches), over batch sizes, K, both fallbacks, fan-outs, prompt-step speculation, preemption and prefix-cache
hits. Sampled outputs follow the target's distribution.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from eagle3_utils import make_test_pairs
from ssd_utils import ExactJoint, chi_square_gof
from test_eagle3_sd import MAX_LEN, PARAMS, PROMPTS, _ar, _iid_pair, _joint

from ssd import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def paths(checkpoint_factory, tmp_path_factory):
    return make_test_pairs(checkpoint_factory, tmp_path_factory.mktemp("eagle3_ssd"))


@pytest.fixture(scope="module")
def ar_greedy(paths):
    return {name: _ar(paths[name]) for name in ("target", "constant")}


def make_ssd(model: str, head: str, k: int = 3, spec: dict | None = None, **kwargs) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_LEN, block_size=BLOCK, seed=0)
    options.update(kwargs)
    options["speculative_config"] = {"method": "ssd", "model": head, "num_speculative_tokens": k,
                                     "adaptive_lookahead": False, "draft_timeout_s": 60.0, **(spec or {})}
    return LLM(model, **options)


PAIRS = [("target", "random_head"), ("constant", "agreeing_head")]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("pair", PAIRS)
def test_greedy_ssd_with_a_head_equals_ar(paths, ar_greedy, pair, k):
    target, head = pair
    llm = make_ssd(paths[target], paths[head], k=k, max_num_seqs=8)
    try:
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [(o.token_ids, o.finish_reason) for o in outputs] == ar_greedy[target]
        stats = llm.stats
        assert llm.engine.proposer.available, llm.engine.proposer.failure
        assert stats.num_drafts > 0 and stats.draft_feature_bytes > 0
        assert stats.cache_hits > 0  # the head's trees serve rounds
        if head == "agreeing_head":
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


CONFIGS = {
    "K3-fanout2-jit-full-builds": dict(k=3, spec={"fan_out": 2, "fallback": "jit", "interruptible_build": False}),
    "K4-auto-random": dict(k=4, spec={"fan_out": "auto", "fallback": "random"}),
    "K4-dynamic-auto-preempt": dict(k=4, spec={"fan_out": "dynamic", "fallback": "auto"}, kv_cache_memory="640KiB"),
    "K3-prompt-step-speculation": dict(k=3, spec={"prompt_step_speculation": True, "fallback": "jit"}),
    "K3-no-lookup-adaptive": dict(k=3, spec={"prompt_lookup": False, "adaptive_lookahead": True}),
    "K2-chunked-prefill": dict(k=2, max_num_batched_tokens=24, enable_chunked_prefill=True),
    "K3-fp16-packed-batch1": dict(k=3, max_num_seqs=1, spec={"draft_weight_format": "fp16-packed",
                                                              "interruptible_build": False}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ssd_with_a_head_in_every_configuration(paths, ar_greedy, name):
    options = dict(CONFIGS[name])
    options.setdefault("max_num_seqs", 8)
    for target, head in PAIRS:
        llm = make_ssd(paths[target], paths[head], **options)
        try:
            outputs = llm.generate(PROMPTS, PARAMS)
            assert [(o.token_ids, o.finish_reason) for o in outputs] == ar_greedy[target], (name, head)
            assert llm.engine.proposer.available, llm.engine.proposer.failure
            stats = llm.stats
            if head == "agreeing_head":
                assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
                if not options["spec"].get("interruptible_build", True) if "spec" in options else False:
                    assert stats.cache_hits >= stats.cache_lookups / 2, stats  # full trees: the bonus branch hits
        finally:
            llm.shutdown()


def test_prefix_cache_hits_leave_the_head_without_features_not_inexact(paths, ar_greedy):
    llm = make_ssd(paths["constant"], paths["agreeing_head"], k=3)
    try:
        first = llm.generate([PROMPTS[6]], [PARAMS[6]])
        again = llm.generate([PROMPTS[6]], [PARAMS[6]])  # its first block comes from the target's prefix cache
        assert first[0].token_ids == again[0].token_ids == ar_greedy["constant"][6][0]
        assert llm.stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_head_that_does_not_fit_is_refused_before_the_worker_starts(paths, tmp_path):
    from eagle3_utils import LAYERS, VOCAB, make_eagle3_head

    wide = make_eagle3_head(tmp_path / "wide", vocab_size=VOCAB, target_hidden_size=96, feature_layers=LAYERS)
    with pytest.raises(ValueError, match="reads hidden states of size 96, the target's are 64"):
        make_ssd(paths["target"], str(wide))
    with pytest.raises(ValueError, match="'gguf'"):  # a head stores no GGUF blocks
        make_ssd(paths["target"], paths["random_head"], spec={"draft_weight_format": "gguf"})


@pytest.mark.parametrize("fallback", ["jit", "random"])
def test_sampled_ssd_with_a_head_follows_the_target(checkpoint_factory, tmp_path, fallback):
    """The first three tokens of sampled requests follow the target's processed joint distribution (as in
    ``test_eagle3_sd.py``, chi-square, false-failure rate 1e-4); rounds are served from the cache and by the
    fallback both."""
    target, head = _iid_pair(checkpoint_factory(arch="llama", vocab_size=259), tmp_path)
    prompt, n = [5, 17, 33], 4000
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)  # the first three are tested
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    expected = _joint(hf, prompt, params, 3)
    # K = 1: a first round (a miss: no first-round build with a head) that rejects its draft leaves the third token
    # to the second round, served from the cache or by the fallback
    llm = make_ssd(target, head, k=1, max_num_seqs=16, spec={"fallback": fallback, "interruptible_build": False,
                                                              "fan_out": 3})
    try:
        outputs = llm.generate([prompt] * n, [dataclasses.replace(params, seed=1000 + i) for i in range(n)])
        stats = llm.stats
    finally:
        llm.shutdown()
    assert 0.3 < stats.acceptance_rate < 0.97, stats.acceptance_rate
    assert stats.cache_hits > 0
    samples = [tuple(o.token_ids[:3]) for o in outputs]
    assert set(samples) <= set(expected)
    result = chi_square_gof(samples, ExactJoint(expected))
    assert result.p_value > 1e-4, f"chi-square p = {result.p_value}"


# --------------------------------------------------------------------------------------------- the engine alone
def test_head_trees_draft_like_the_head_alone(paths):
    """In the draft worker's engine, in-process: the fallback's drafts and every cached branch equal the head run
    alone, a row at a time on a fresh cache, on the same text with the target's features for the positions the
    target has computed and its own outputs after them. Two rounds: the second catches up on the target's features
    of the drafts the first accepted, which replace the head's own."""
    from ssd.core.block_pool import BlockPool
    from ssd.core.kv_cache_manager import KVCacheManager
    from ssd.models.eagle3 import load_eagle3_head
    from ssd.models.loader import load_arch_config, load_input_embedding
    from ssd.options import Fallback, LookupConfig
    from ssd.runtime.forward_items import ForwardItem
    from ssd.speculative.async_draft.draft_state import SpeculateRow
    from ssd.speculative.async_draft.head_engine import HeadDraftEngine
    from ssd.speculative.drafting import DraftDistribution
    from ssd.speculative.head_runner import HeadRunner

    K, block, blocks, vocab = 3, 4, 96, 512
    target = paths["target"]
    head, _ = load_eagle3_head(paths["random_head"], load_arch_config(target), torch.float32,
                               load_input_embedding(target))
    dist = DraftDistribution(vocab, vocab, head.draft_to_target)
    engine = HeadDraftEngine(HeadRunner(head, blocks, block, "cpu"), KVCacheManager(BlockPool(blocks, block, False)),
                             dist, K, lookup=LookupConfig(enabled=False))
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(64, 3 * 64, generator=gen)  # the target's feature of position p: features[p]

    def alone(tokens: list[int], computed: int) -> list[int]:
        """K greedy drafts after ``tokens``, the target having computed positions 0..computed-1."""
        runner = HeadRunner(head, blocks, block, "cpu")
        table, text, drafts, feature = list(range(blocks)), list(tokens), [], None
        for p in range(len(tokens) - 1 + K - 1):  # row p takes text[p + 1]
            g = runner.fuse(features[p : p + 1]) if p < computed else feature[None]
            feature = runner.forward([ForwardItem([text[p + 1]], p, table)], g)[0][0]
            if p + 2 == len(text):  # the last token's row: its logits give the next token
                text.append(int(dist.greedy_tokens(runner.logits(feature[None]))[0]))
                drafts.append(text[-1])
        return drafts

    prompt = torch.randint(3, vocab, (9,), generator=gen).tolist()
    GREEDY = SamplingParams(temperature=0.0)
    engine.prefill([(0, prompt, GREEDY)])
    first = 11  # the token the target's prompt step emits
    [served] = engine.speculate([SpeculateRow(0, [first], -1, K, K, (0, features[:9]))], Fallback.JIT)
    assert served.fallback is Fallback.JIT and served.tokens == alone(prompt + [first], 9)
    text = prompt + [first]
    for round_ in range(2):
        engine.build_cache({0: [2] * (K + 1)})
        cache = engine.states[0].cache
        assert len(cache) == 2 * K + 2
        for (k, c), cached in cache.items():
            assert cached.tokens == alone(text + served.tokens[:k] + [c], len(text) - 1), (round_, k, c)
        # the target accepts one draft and emits a cached recovery token: the next request hits
        k, c = next(key for key in cache if key[0] == 1)
        computed = len(text) - 1
        new = served.tokens[:1] + [c]
        [served] = engine.speculate([SpeculateRow(0, new, 1, K, K, (computed, features[computed : computed + 2]))],
                                    Fallback.JIT)
        assert served.hit and served.tokens == cache[(1, c)].tokens
        text += new


def test_a_block_format_target_hands_the_head_its_features_from_the_layer_stack(paths):
    """A q8_0 target runs its layers in one C++ call (``ssd/models/layer_stack.py``), which returns the features
    too (the Python layers' bits: ``test_layer_stack.py``): SD and SSD with a head stay exact against that
    target's AR."""
    from ssd.models import cpu_fused
    from test_eagle3_sd import make_llm

    if not cpu_fused.available():
        pytest.skip("the CPU kernels could not be compiled")
    target, head = paths["constant"], paths["agreeing_head"]
    ar = make_llm(target, weight_format="q8_0")
    expected = [o.token_ids for o in ar.generate(PROMPTS, PARAMS)]
    assert ar.engine.runner.model.layer_stack is not None
    for llm in (make_llm(target, head, k=3, weight_format="q8_0", max_num_seqs=8),
                make_ssd(target, head, k=3, weight_format="q8_0", max_num_seqs=8)):
        try:
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
            assert llm.engine.runner.model.layer_stack is not None
            assert llm.stats.num_accepted_tokens == llm.stats.num_draft_tokens > 0
        finally:
            llm.shutdown()
