"""Target-processed distributions, token sampling with per-request generators, and logprobs.

`processed_probs` is the single definition of "the distribution a request samples from". Plain sampling,
speculative verification (p) and drafting (q) all call it, so temperature, top-k and top-p are applied
identically everywhere and speculation stays exact (docs/design.md, "A round of speculation").

Sampling uses inverse-CDF with one float64 uniform per row, drawn from that row's own generator. A seeded
request therefore reproduces its tokens whatever else is in its batch and wherever it sits in it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ssd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SamplingTensors:
    """Per-row sampling options as device tensors, built once per step.

    Greedy rows carry neutral values (temperature 1, top-k off, top-p 1) so the vectorised sampled path
    never divides by zero; their rows are overwritten by one-hots afterwards. The python flags let
    `processed_probs` skip whole stages (a full-vocabulary sort for top-p) when no row needs them.
    """

    temperature: torch.Tensor  # [N] float32, > 0
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32 in (0, 1], 1 = off
    min_p: torch.Tensor  # [N] float32 in [0, 1], 0 = off
    greedy: torch.Tensor  # [N] bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_greedy: bool
    max_top_k: int  # largest active top_k (0 if none): bounds the torch.topk width without a device sync

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [0 if g or p.top_k <= 0 else p.top_k for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_ps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            any_top_k=any(k > 0 for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(p > 0.0 for p in min_ps),
            all_greedy=bool(greedy) and all(greedy),
            max_top_k=max(top_ks, default=0),
        )

    @property
    def num_rows(self) -> int:
        return int(self.greedy.shape[0])

    def expand(self, repeats: int) -> SamplingTensors:
        """Row i becomes rows i*repeats .. i*repeats+repeats-1: matches `[N, S, V].reshape(N*S, V)`."""
        return SamplingTensors(
            temperature=self.temperature.repeat_interleave(repeats),  # [N*S]
            top_k=self.top_k.repeat_interleave(repeats),  # [N*S]
            top_p=self.top_p.repeat_interleave(repeats),  # [N*S]
            min_p=self.min_p.repeat_interleave(repeats),  # [N*S]
            greedy=self.greedy.repeat_interleave(repeats),  # [N*S]
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
            all_greedy=self.all_greedy,
            max_top_k=self.max_top_k,
        )


def expand(st: SamplingTensors, repeats: int) -> SamplingTensors:
    """Per-row options repeated for `repeats` positions per row (e.g. the K+1 verify positions)."""
    return st.expand(repeats)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from, after temperature, top-k and top-p.

    Accepts `[N, V]` or `[N, S, V]` (S positions per row sharing that row's options, as in
    verification); returns float32 of the same shape whose rows sum to 1.

    Rules (deterministic and independent of token order except where stated):
    - greedy rows: one-hot at argmax of the raw logits, lowest index on ties (torch.argmax).
    - temperature: logits are shifted by their row max before dividing, so tiny temperatures give
      exact zeros instead of inf/NaN.
    - top-k: keep every token whose logit is >= the k-th largest logit. Ties at the k-th value are all
      kept, so more than k tokens may survive; this makes the kept set independent of token order.
    - top-p (after top-k, on the renormalised probabilities): sort descending; keep the smallest prefix
      whose cumulative probability reaches top_p (a token is kept iff the mass strictly before it is
      < top_p, so the most likely token always survives), then also keep every token whose probability
      equals that of the last kept one (ties at the boundary are all kept, as for top-k).
    - min-p (last, on the renormalised probabilities): keep every token whose probability is >= min_p times the
      largest; the likeliest tokens always survive.
    Logits must be finite or -inf (masked); a row of all -inf has no distribution.
    """
    if logits.dim() == 3:
        n, s, v = logits.shape
        out = processed_probs(logits.reshape(n * s, v), st.expand(s))  # [N*S, V]
        return out.reshape(n, s, v)  # [N, S, V]
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [N, V] or [N, S, V], got {tuple(logits.shape)}")
    if logits.shape[0] != st.num_rows:
        raise ValueError(
            f"logits have {logits.shape[0]} rows but the sampling tensors have {st.num_rows}"
        )
    logits = logits.float()  # [N, V]
    argmax = logits.argmax(dim=-1)  # [N]
    one_hot = torch.zeros_like(logits).scatter_(1, argmax[:, None], 1.0)  # [N, V]
    if st.all_greedy:
        return one_hot

    x = (logits - logits.amax(dim=-1, keepdim=True)) / st.temperature[:, None]  # [N, V]
    if st.any_top_k:
        x = _apply_top_k(x, st.top_k, st.max_top_k)
    probs = torch.softmax(x, dim=-1)  # [N, V]
    if st.any_top_p:
        probs = _apply_top_p(probs, st.top_p)
    if st.any_min_p:
        kept = torch.where(probs >= st.min_p[:, None] * probs.amax(dim=-1, keepdim=True), probs, 0.0)  # [N, V]
        probs = kept / kept.sum(dim=-1, keepdim=True)
    return torch.where(st.greedy[:, None], one_hot, probs)  # [N, V]


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Masks logits below each row's k-th largest value; rows with k == 0 or k >= V are untouched."""
    vocab = x.shape[-1]
    width = max(1, min(max_top_k, vocab))
    top_vals = torch.topk(x, width, dim=-1).values  # [N, width], descending
    active = (top_k > 0) & (top_k < vocab)  # [N]
    kth_index = (top_k.clamp(min=1, max=width) - 1)[:, None]  # [N, 1]
    kth = top_vals.gather(1, kth_index)  # [N, 1]
    kth = torch.where(active[:, None], kth, torch.full_like(kth, float("-inf")))  # [N, 1]
    return x.masked_fill(x < kth, float("-inf"))  # [N, V]


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the nucleus (with boundary ties) and renormalises; rows with top_p == 1 are untouched."""
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values  # [N, V]
    cum = sorted_probs.cumsum(dim=-1)  # [N, V]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [N, V]
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)  # [N, 1], >= 1
    threshold = sorted_probs.gather(1, num_kept - 1)  # [N, 1]
    threshold = torch.where(top_p[:, None] < 1.0, threshold, torch.zeros_like(threshold))  # [N, 1]
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))  # [N, V]
    return kept / kept.sum(dim=-1, keepdim=True)  # [N, V]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator (None when unseeded: such rows share the default/global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    counts: Sequence[int],
    width: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Uniforms in [0, 1) as float64 `[N, width]`; row i's first counts[i] entries are its draws.

    Reproducibility contract: a row with its own generator consumes exactly one call
    `torch.rand(counts[i], dtype=float64, generator=g, device=g.device)`, whatever the other rows are.
    Rows without one share a single call on `default_generator` (or torch's global RNG) of shape
    `[num_unseeded_rows, width]`; entries past counts[i] are zero and must not be used.
    """
    n = len(generators)
    if len(counts) != n:
        raise ValueError(f"got {len(counts)} draw counts for {n} generators")
    if any(c < 0 or c > width for c in counts):
        raise ValueError(f"draw counts must be in [0, {width}], got {list(counts)}")
    device = torch.device(device)
    u = torch.zeros(n, width, dtype=torch.float64, device=device)  # [N, width]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        gen_device = default_generator.device if default_generator is not None else device
        batch = torch.rand(
            len(unseeded), width, dtype=torch.float64, generator=default_generator, device=gen_device
        )  # [n_unseeded, width]
        u[torch.tensor(unseeded, device=device)] = batch.to(device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:
        rows = []
        for i in seeded:
            g = generators[i]
            assert g is not None
            r = torch.rand(counts[i], dtype=torch.float64, generator=g, device=g.device)  # [counts[i]]
            rows.append(torch.nn.functional.pad(r.to(device), (0, width - counts[i])))  # [width]
        u[torch.tensor(seeded, device=device)] = torch.stack(rows)  # [n_seeded, width]
    return u


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i returns the token whose cumulative interval contains u[i] * total.

    Zero-probability tokens have empty intervals and can never be returned. The cumulative sum is in
    float64 so vocabularies of 10^5+ tokens keep ~1e-12 resolution. Rows need not be normalised.
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [N, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N]
    # u * total can round up to total itself; then the answer is the last token with mass.
    vocab = probs.shape[-1]
    last_nonzero = (vocab - 1) - (probs.flip(-1) > 0).to(torch.int32).argmax(dim=-1)  # [N]
    return torch.minimum(idx, last_nonzero)  # [N]


def sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: torch.Tensor,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draws one token per row from `probs` `[N, V]` (normally `processed_probs`); greedy rows argmax.

    Randomness consumed per call: every row with its own generator draws exactly one float64 uniform
    (`torch.rand(1, dtype=float64)`) from it, greedy or not, so its stream advances identically in every
    batch. Unseeded rows use one shared draw on `default_generator` or torch's global RNG.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape [N, V], got {tuple(probs.shape)}")
    n = probs.shape[0]
    if len(generators) != n or greedy.shape != (n,):
        raise ValueError(
            f"probs has {n} rows but got {len(generators)} generators and greedy of shape "
            f"{tuple(greedy.shape)}"
        )
    u = draw_uniforms(generators, [1] * n, 1, probs.device, default_generator)  # [N, 1]
    if bool(greedy.all()):  # the draws above keep generator streams identical; the CDF is not needed
        return probs.argmax(dim=-1)  # [N]
    sampled = sample_with_uniforms(probs, u[:, 0])  # [N]
    return torch.where(greedy.to(probs.device), probs.argmax(dim=-1), sampled)  # [N]


@dataclass
class LogprobsResult:
    """Logprobs for OpenAI-style responses, from the raw model distribution (see compute_logprobs)."""

    chosen_logprobs: torch.Tensor  # [N] float32
    chosen_ranks: torch.Tensor  # [N] int64, 1 = most likely
    top_ids: torch.Tensor | None  # [N, num_top] int64, descending logprob; None when num_top == 0
    top_logprobs: torch.Tensor | None  # [N, num_top] float32


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsResult:
    """Logprobs from log_softmax of the *unprocessed* logits (no temperature/top-k/top-p).

    This matches vLLM's default (raw logprobs): the numbers describe the model, not the sampling
    options, so they stay finite for tokens that top-k/top-p excluded and do not change with
    temperature. A chosen token's rank is 1 + the number of tokens with a strictly larger logprob.
    """
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"expected logits [N, V] and token_ids [N], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = token_ids.to(device=logits.device, dtype=torch.int64)[:, None]  # [N, 1]
    chosen = logprobs.gather(1, ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    top_ids = top_lp = None
    if num_top > 0:
        top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
        top_ids, top_lp = top.indices, top.values  # [N, num_top]
    return LogprobsResult(
        chosen_logprobs=chosen.squeeze(-1), chosen_ranks=ranks, top_ids=top_ids, top_logprobs=top_lp
    )
