"""Structured outputs (``SamplingParams.structured_outputs``; ``ssd/structured/``), exact under speculation.

A grammar masks every position's logits to the tokens it allows after the tokens before that position; under
SD and SSD a verified position's mask is the grammar's state after the drafts before it. Checked: the bitmask
arithmetic; the per-position masks of a round against a grammar advanced token by token; every constraint kind
yields outputs that parse / match; greedy constrained tokens are the same in every mode and batch size; sampled
SD and SSD outputs follow the constrained target distribution (chi-square against an exact enumeration); bad
constraints are refused with a clear error and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from eagle3_utils import SPEC_MODES, make_mode_models, self_draft_stats
from ssd_utils import chi_square_gof, exact_joint

from ssd import LLM, SamplingParams
from ssd.structured.bitmask import apply_bitmasks, unpack
from ssd.structured.grammar import GrammarCompiler
from ssd.structured.spec import StructuredOutputs
from ssd.tokenizer import Tokenizer

ENGINE = dict(dtype="float32", block_size=4, max_model_len=200, kv_cache_memory="16MiB", seed=0)
PROMPTS = ["Describe a colour:", [100, 3, 250, 7, 41, 9]]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["colour", "ok", "tag", "n"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue", "purple haze"]
LARK = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/'
GBNF = 'root ::= "id-" [a-f0-9] [a-f0-9] [a-f0-9]? "."'

CONSTRAINTS = {
    "json": dict(json=SCHEMA, disable_any_whitespace=True),
    "json_object": dict(json_object=True, disable_any_whitespace=True),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=CHOICES),
    "lark": dict(grammar=LARK),
    "gbnf": dict(grammar=GBNF),
}


def _conforms(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return set(value) == set(SCHEMA["required"]) and value["colour"] in ("red", "green", "blue") \
            and isinstance(value["ok"], bool) and re.fullmatch("[a-z]{1,6}", value["tag"]) is not None \
            and isinstance(value["n"], int) and 0 <= value["n"] <= 999
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "lark":
        return re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text) is not None
    return re.fullmatch(r"id-[a-f0-9]{2,3}\.", text) is not None


def _params(kind: str, **options) -> SamplingParams:
    return SamplingParams(max_tokens=60, structured_outputs=CONSTRAINTS[kind], **options)


# ------------------------------------------------------------------------------------------------ pieces
def test_unpack_reads_bit_i_of_word_w_as_token_32w_plus_i():
    gen = torch.Generator().manual_seed(0)
    masks = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    allowed = unpack(masks, 100)
    for r in range(3):
        for t in range(100):
            assert bool(allowed[r, t]) == bool((int(masks[r, t // 32]) >> (t % 32)) & 1)
    logits = torch.zeros(5, 100)
    apply_bitmasks(logits, [1, 4, 2], masks)
    assert torch.equal(torch.isneginf(logits[[1, 4, 2]]), ~allowed) and not torch.isinf(logits[[0, 3]]).any()


def test_a_draft_keeps_to_the_grammar_in_its_own_vocabulary():
    """``DraftDistribution.constrain`` masks draft columns by their target ids (a reduced draft vocabulary maps
    them); a row allowing nothing the draft can propose keeps its logits."""
    from ssd.speculative.drafting import DraftDistribution

    draft_to_target = torch.tensor([3, 0, 7, -1, 5])  # draft column -> target id (-1: none)
    dist = DraftDistribution(10, 10, draft_to_target)
    allowed = torch.zeros(2, 1, dtype=torch.int32)
    allowed[0, 0] = (1 << 7) | (1 << 5)  # row 0: target ids 7 and 5
    allowed[1, 0] = 1 << 9  # row 1: target id 9, which the draft cannot propose
    logits = torch.randn(3, 5)
    out = dist.constrain(logits, ([0, 2], allowed))
    assert torch.isneginf(out[0]).tolist() == [True, True, False, True, False]
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2], logits[2])
    assert dist.greedy_tokens(out[:1]).item() in (7, 5)


def test_a_rounds_masks_are_the_grammars_states_after_each_prefix_of_the_drafts(checkpoint_factory):
    tokenizer = Tokenizer(checkpoint_factory())
    compiler = GrammarCompiler.for_tokenizer(tokenizer, 512)
    spec = StructuredOutputs(regex=REGEX)
    text_ids = tokenizer.hf_tokenizer.encode("123-abc", add_special_tokens=False)
    grammar, stepwise = compiler.compile(spec), compiler.compile(spec)
    grammar.advance(text_ids[0])
    stepwise.advance(text_ids[0])
    drafts = text_ids[1:]
    masks = grammar.masks_along(drafts)
    for j, token in enumerate(drafts):
        assert torch.equal(masks[j], stepwise.masks_along([])[0])
        stepwise.advance(token)
    assert torch.equal(masks[-1], stepwise.masks_along([])[0])
    assert torch.equal(grammar.masks_along([])[0], compiler.compile(spec).masks_along(text_ids[:1])[1])  # unmoved
    encode = lambda text: tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # After "123-arey" the grammar is complete and stopped; llguidance then does not record an EOS it consumes,
    # and rolling back over the EOS would undo one token too many.
    eos = tokenizer.eos_token_id
    dashed = compiler.compile(spec)
    for token in encode("123-"):
        dashed.advance(token)
    before = dashed.masks_along([])
    ended = dashed.masks_along(encode("ar") + encode("ey") + [eos] + encode("c"))
    assert unpack(ended[-2].unsqueeze(0), 512)[0, eos]  # the EOS is allowed there
    assert torch.equal(ended[-1], ended[-2])  # nothing follows an EOS: its row repeats
    assert torch.equal(dashed.masks_along([]), before)
    bad = tokenizer.hf_tokenizer.encode("x", add_special_tokens=False)[0]  # refused at the first position
    refused = grammar.masks_along([bad, text_ids[1]])
    assert torch.equal(refused[1], refused[0]) and torch.equal(refused[2], refused[0])


@pytest.mark.parametrize("value, match", [
    (dict(), "exactly one of json, json_object, regex, grammar, choice; got none"),
    (dict(regex="a", choice=["b"]), "got regex, choice"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json=[1]), "json must be a JSON schema object"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice must be a non-empty list of non-empty strings"),
    (dict(json_object="yes"), "json_object must be true or false"),
    (dict(regex="a", whitespace=True), "unknown fields \\['whitespace'\\]"),
])
def test_bad_constraint_shapes_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=value)


@pytest.mark.parametrize("value, match", [
    (dict(regex="[a-"), "(?s)the regex does not compile: .*unclosed character class"),
    (dict(json={"type": "objekt"}), "the json does not compile: .*objekt"),
    (dict(grammar="start: foo"), "the grammar does not compile: .*foo"),
])
def test_constraints_that_do_not_compile_are_refused_and_the_engine_keeps_serving(checkpoint_factory, value, match):
    llm = LLM(str(checkpoint_factory()), **ENGINE)
    with pytest.raises(ValueError, match=match):
        llm.generate(["hi"], SamplingParams(structured_outputs=value))
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids


# ------------------------------------------------------------------------------------------------ outputs
def test_every_constraint_kind_yields_conforming_outputs(checkpoint_factory):
    """Any JSON object's keys and strings are unbounded: a bias towards closing quotes and braces lets the random
    model finish them."""
    path = checkpoint_factory()
    llm = LLM(str(path), **ENGINE, max_num_seqs=8)
    encode = Tokenizer(path).hf_tokenizer.convert_tokens_to_ids
    closing = {"json_object": dict(logit_bias={encode('"'): 8.0, encode("}"): 8.0})}
    kinds = list(CONSTRAINTS)
    params = [_params(k, temperature=0.0, **closing.get(k, {})) for k in kinds]
    params += [_params(k, temperature=1.0, seed=7, **closing.get(k, {})) for k in kinds]
    outputs = llm.generate([PROMPTS[0]] * len(params), params)
    for kind, out in zip(kinds + kinds, outputs):
        assert out.finish_reason == "stop", (kind, out.text)
        assert _conforms(kind, out.text), (kind, out.text)


def test_a_grammar_allowing_only_eos_overrides_min_tokens(checkpoint_factory):
    llm = LLM(str(checkpoint_factory()), **ENGINE)
    out = llm.generate(["Pick:"], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20,
                                                 structured_outputs=dict(choice=["red", "blue"])))[0]
    assert out.text in ("red", "blue") and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory):
    return make_mode_models(checkpoint_factory, tmp_path_factory.mktemp("structured"))


def _greedy_batch() -> tuple[list, list[SamplingParams]]:
    prompts, params = [], []
    for kind in CONSTRAINTS:
        for prompt in PROMPTS:
            prompts.append(prompt)
            params.append(_params(kind, temperature=0.0))
    return prompts, params


@pytest.fixture(scope="module")
def constrained_ar(models):
    target, _, _ = models
    prompts, params = _greedy_batch()
    with LLM(target, **ENGINE, max_num_seqs=1) as one, LLM(target, **ENGINE, max_num_seqs=16) as many:
        expected = [o.token_ids for o in one.generate(prompts, params)]
        assert [o.token_ids for o in many.generate(prompts, params)] == expected
        unconstrained = [o.token_ids for o in one.generate(prompts, [dataclasses.replace(p, structured_outputs=None)
                                                                     for p in params])]
    assert expected != unconstrained
    return expected


@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_greedy_constrained_tokens_equal_plain_decoding_in_every_mode(models, constrained_ar, mode):
    target, draft, head = models
    prompts, params = _greedy_batch()
    spec = {**SPEC_MODES[mode](draft, head), "num_speculative_tokens": 3, "adaptive_lookahead": False}
    with LLM(target, **ENGINE, max_num_seqs=6, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == constrained_ar
        assert llm.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "ssd"])
def test_drafts_are_drawn_from_the_grammars_allowed_tokens(models, method):
    """With the target as its own draft, a draft masked like the target agrees with it at every position up to the
    EOS that ends a request (drafts after it count as rejected); the grammar makes letters and digits alternate, so
    an unmasked draft would almost never propose an allowed token (measured: 0 of 98 accepted). SSD's worker
    follows each sequence's grammar and keeps its tree's drafts and fork candidates to it."""
    target, _, _ = models
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=dict(regex="([a-z][0-9])+"))
    stats = self_draft_stats(target, PROMPTS, params, method, ENGINE)
    assert stats.num_accepted_tokens >= 0.75 * stats.num_draft_tokens > 0
    if method == "ssd":  # the forks offer allowed candidates only, so the target's bonus tokens hit (12 of 12;
        assert stats.cache_hits >= 0.75 * stats.cache_lookups > 0  # 1 of 8 with unmasked forks)


# ------------------------------------------------------------------------------------------------ sampled
@pytest.mark.parametrize("method", ["draft_model", "ssd"])
def test_sampled_constrained_outputs_follow_the_target(models, method):
    """Five tokens of 1,500 seeded requests (top-k 2 after the mask) against the constrained joint distribution
    enumerated exactly, and told apart from the unconstrained one. Letters and digits alternate: unmasked drafts
    would never be accepted."""
    target, draft, _ = models
    regex = "([a-z][0-9])+"
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=5, structured_outputs=dict(regex=regex))
    prompt = [17, 244, 90, 3, 411, 58]
    tokenizer = Tokenizer(target)
    compiler = GrammarCompiler.for_tokenizer(tokenizer, 512)

    def constraint(path):
        grammar = compiler.compile(params.structured_outputs)
        for token in path:
            grammar.advance(token)
        return None if grammar.terminated else grammar.masks_along([])

    exact = exact_joint(target, prompt, 5, params, constraint)
    unconstrained = exact_joint(target, prompt, 5, dataclasses.replace(params, structured_outputs=None))
    spec = {"method": method, "model": draft, "num_speculative_tokens": 2, "adaptive_lookahead": False,
            "prompt_lookup": False}
    with LLM(target, **ENGINE, max_num_seqs=128, speculative_config=spec) as llm:
        outputs = llm.generate([prompt] * 1500, [dataclasses.replace(params, seed=s) for s in range(1500)])
        assert llm.stats.num_accepted_tokens > 0
    samples = [tuple(o.token_ids) for o in outputs]
    result = chi_square_gof(samples, exact)
    assert result.df >= 10 and result.p_value > 1e-4, result
    assert chi_square_gof(samples, unconstrained).p_value < 1e-4  # the test tells the two apart
