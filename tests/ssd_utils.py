"""Helpers for the SSD tests: draft checkpoints derived from a target, exact sampling references, chi-square.

A draft made by ``make_perturbed_draft`` shares the target's config and tokenizer and has weights
``w + sigma * std(w) * noise``: small ``sigma`` gives partial acceptance, so rounds see cache hits and
misses and every acceptance length k. Exact references enumerate the target's processed distribution over
a small support (top-k sampling), so sampled outputs can be tested against true probabilities.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from scipy import stats

from model_utils import PagedSession
from ssd import LLM
from ssd.models.loader import load_model
from ssd.sample.penalties import PenaltyRow, apply_penalties
from ssd.sample.sampler import SamplingTensors, processed_probs
from ssd.sampling_params import SamplingParams
from ssd.structured.bitmask import apply_bitmasks

WEIGHTS = "model.safetensors"


def make_perturbed_draft(target: Path, dst: Path, sigma: float, seed: int = 1) -> Path:
    """Copy ``target`` (config + tokenizer) to ``dst`` with every weight tensor perturbed by relative noise."""
    dst = Path(dst)
    shutil.copytree(target, dst, dirs_exist_ok=True)
    weights = load_file(Path(target) / WEIGHTS)
    gen = torch.Generator().manual_seed(seed)
    noisy = {}
    for name in sorted(weights):
        w = weights[name]
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
        noisy[name] = (w.float() + sigma * w.float().std() * noise).to(w.dtype).contiguous()
    save_file(noisy, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def make_corrupt_checkpoint(target: Path, dst: Path) -> Path:
    """Config and tokenizer of ``target`` intact, weights file garbage: fails only when the weights load."""
    dst = Path(dst)
    shutil.copytree(target, dst, dirs_exist_ok=True)
    (dst / WEIGHTS).write_bytes(b"\x07not a safetensors file" * 64)
    return dst


@dataclass
class ExactJoint:
    """P(first n generated tokens = path) for every path with positive probability."""

    probs: dict[tuple[int, ...], float]


@torch.inference_mode()
def exact_joint(model_path: Path, prompt: list[int], num_tokens: int, params: SamplingParams,
                constraint: Callable[[tuple[int, ...]], torch.Tensor | None] | None = None) -> ExactJoint:
    """Enumerate the target's processed distribution (penalties, temperature, top-k, top-p, min-p) over
    ``num_tokens`` steps.

    ``constraint(path)``: the ``[1, W]`` bitmask of tokens a grammar allows after ``path``, or None where the
    grammar is complete (the path ends there, as the engine ends the request).
    Only practical when the support per step is tiny (e.g. top_k=2): the tree has support**num_tokens leaves.
    """
    model, _ = load_model(str(model_path), dtype=torch.float32, device=torch.device("cpu"))
    model.eval()
    st = SamplingTensors.from_params([params], "cpu")
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(num_tokens):
        nxt: dict[tuple[int, ...], float] = {}
        for path, mass in frontier.items():
            mask = constraint(path) if constraint is not None else None
            if constraint is not None and mask is None:
                nxt[path] = mass
                continue
            tokens = prompt + list(path)
            session = PagedSession(model, num_blocks=(len(tokens) // 4) + 2, block_size=4)
            logits = session.step({0: tokens})[0][-1:]  # [1, V]
            apply_penalties(logits, [PenaltyRow(0, params, prompt, list(path))])
            if mask is not None:
                apply_bitmasks(logits, [0], mask)
            probs = processed_probs(logits, st)[0].double()  # [V]
            for token in torch.nonzero(probs > 0).flatten().tolist():
                nxt[path + (token,)] = mass * float(probs[token])
        frontier = nxt
    return ExactJoint(frontier)


@dataclass
class ChiSquare:
    statistic: float
    df: int
    p_value: float


def chi_square_gof(samples: list[tuple[int, ...]], exact: ExactJoint, min_expected: float = 5.0) -> ChiSquare:
    """Pearson goodness of fit of observed paths against exact probabilities.

    Cells expected below ``min_expected`` are pooled (with any path the reference says is impossible), so
    the chi-square approximation holds; an impossible path that occurs makes the statistic infinite.
    """
    n = len(samples)
    counts = Counter(samples)
    impossible = sum(c for path, c in counts.items() if path not in exact.probs)
    if impossible:
        return ChiSquare(math.inf, 0, 0.0)
    observed, expected = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for path, p in exact.probs.items():
        if n * p >= min_expected:
            observed.append(counts.get(path, 0))
            expected.append(n * p)
        else:
            pooled_obs += counts.get(path, 0)
            pooled_exp += n * p
    if pooled_exp >= min_expected or (pooled_exp > 0 and not expected):
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    elif pooled_exp > 0:  # still too small on its own: fold it into the smallest cell
        smallest = min(range(len(expected)), key=expected.__getitem__)
        observed[smallest] += pooled_obs
        expected[smallest] += pooled_exp
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return ChiSquare(statistic, df, float(stats.chi2.sf(statistic, df)))


QUANTIZED_PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(4 + 3 * i)] for i in range(5)]
QUANTIZED_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def assert_every_mode_decodes_like_ar(target: str, draft: str, engine: dict, draft_weight_format: str | None = None,
                                      ngram_k: int = 3) -> None:
    """A target with quantized activations (``engine`` names its weight format) runs the row-invariant attention
    and decodes the same greedy tokens alone, batched, and under SD, SSD (jit fallback) and ngram; the draft
    (in ``draft_weight_format`` when given) has some of its tokens accepted."""
    with LLM(target, **engine) as ar:
        assert ar.engine.runner.row_invariant_attention
        expected = [o.token_ids for o in ar.generate(QUANTIZED_PROMPTS, QUANTIZED_GREEDY)]
        assert [ar.generate([p], QUANTIZED_GREEDY)[0].token_ids for p in QUANTIZED_PROMPTS] == expected
    draft_options = {"model": draft}
    if draft_weight_format is not None:
        draft_options["draft_weight_format"] = draft_weight_format
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3},
                 {"method": "ssd", "num_speculative_tokens": 3, "fallback": "jit"},
                 {"method": "ngram", "num_speculative_tokens": ngram_k}):
        config = {**spec, **({} if spec["method"] == "ngram" else draft_options)}
        with LLM(target, speculative_config=config, **engine) as llm:
            assert [o.token_ids for o in llm.generate(QUANTIZED_PROMPTS, QUANTIZED_GREEDY)] == expected, spec["method"]
            if spec["method"] != "ngram" and draft_weight_format is not None:
                assert llm.stats.num_accepted_tokens > 0
