"""Speculative verification (rejection sampling): exact by construction, pure tensors, no model code.

Given the target's processed distributions p_0..p_K over the speculation [t_n, d_1..d_K] and the exact
distributions q_1..q_K the drafts were drawn from, emits the accepted prefix plus one recovery or bonus
token. The emitted tokens are distributed exactly as sampling from p autoregressively (docs/design.md, "A round
of speculation"), whatever q is, as long as q_i is truly the distribution d_i was drawn from.

Indexing: drafts are 0-based here, so draft j (= d_{j+1}) is checked against p_j = target_probs[:, j]
and q_j = draft_probs[:, j].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ssd.sample.sampler import draw_uniforms, sample_with_uniforms

logger = logging.getLogger(__name__)


@dataclass
class VerifyResult:
    """Per row: how many drafts were accepted, and the tokens to append to the sequence."""

    num_accepted: list[int]  # k per row, in [0, n_i]
    output_tokens: list[list[int]]  # accepted drafts then the recovery/bonus token; length k + 1


def verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    num_draft_tokens: Sequence[int] | None = None,
    default_generator: torch.Generator | None = None,
) -> VerifyResult:
    """Accepts drafts in order and emits one recovery or bonus token per row.

    Shapes: target_probs [B, K+1, V], draft_probs [B, K, V], draft_tokens [B, K], greedy [B] bool.
    Row i uses only its first n_i = num_draft_tokens[i] drafts (default K); its other draft entries are
    ignored (they may hold any padding value, e.g. -1) and its bonus comes from p_{n_i}; n_i = 0 is
    plain sampling from p_0.

    - greedy rows: accept draft j iff it equals argmax p_j; emit argmax p_k where k = accepted count
      (the correction at the first mismatch, or the bonus). draft_probs are not read for them.
    - sampled rows: accept draft j iff q_j(d) > 0 and u_j * q_j(d) < p_j(d), i.e. with probability
      min(1, p/q); a draft with q(d) = 0 could not have been drawn from q and is rejected. At the
      first rejection sample from norm(max(0, p_k - q_k)), or from p_k if rounding left that residual
      all zero; if all n_i drafts are accepted sample the bonus from p_{n_i}.

    Randomness consumed: each row with its own generator makes exactly one call
    `torch.rand(n_i + 1, dtype=float64)` on it (greedy rows too, so streams never depend on outcomes
    or batch composition): entries 0..n_i-1 are the acceptance uniforms u_j, entry n_i drives the
    inverse-CDF draw of the final token. With n_i = 0 this is the same single draw as
    `ssd.sample.sampler.sample`, so the two give identical tokens from identical generator states.
    Unseeded rows share one draw on `default_generator` (or torch's global RNG).
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got {tuple(target_probs.shape)}")
    b, k_plus_1, vocab = target_probs.shape
    max_drafts = k_plus_1 - 1
    if draft_probs.shape != (b, max_drafts, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = {(b, max_drafts, vocab)}, got {tuple(draft_probs.shape)}"
        )
    if draft_tokens.shape != (b, max_drafts):
        raise ValueError(
            f"draft_tokens must be [B, K] = {(b, max_drafts)}, got {tuple(draft_tokens.shape)}"
        )
    if greedy.shape != (b,) or len(generators) != b:
        raise ValueError(
            f"need greedy of shape ({b},) and {b} generators, got {tuple(greedy.shape)} and "
            f"{len(generators)}"
        )
    if num_draft_tokens is None:
        counts = [max_drafts] * b
    else:
        counts = [int(n) for n in num_draft_tokens]
        if len(counts) != b or any(n < 0 or n > max_drafts for n in counts):
            raise ValueError(
                f"num_draft_tokens must list {b} values in [0, {max_drafts}], got {list(num_draft_tokens)}"
            )

    device = target_probs.device
    greedy = greedy.to(device)  # [B]
    n = torch.tensor(counts, dtype=torch.int64, device=device)  # [B]
    valid = torch.arange(max_drafts, device=device)[None, :] < n[:, None]  # [B, K]
    tokens = torch.where(valid, draft_tokens.to(device=device, dtype=torch.int64), 0)  # [B, K]

    u = draw_uniforms(generators, [c + 1 for c in counts], k_plus_1, device, default_generator)  # [B, K+1]

    p_argmax = target_probs.argmax(dim=-1)  # [B, K+1]
    accept = tokens == p_argmax[:, :max_drafts]  # [B, K], greedy rows
    if bool(greedy.all()):  # the uniforms above keep generator streams identical; q and p are not needed
        num_accepted = _accepted_prefix(accept & valid)  # [B]
        return _result(tokens, num_accepted, p_argmax.gather(1, num_accepted[:, None]).squeeze(1))
    p = target_probs.float()  # [B, K+1, V]
    q = draft_probs.float().to(device)  # [B, K, V]
    p_d = p[:, :max_drafts].gather(2, tokens[..., None]).squeeze(-1)  # [B, K]
    q_d = q.gather(2, tokens[..., None]).squeeze(-1)  # [B, K]
    accept_sampled = (q_d > 0) & (u[:, :max_drafts] * q_d < p_d)  # [B, K]
    num_accepted = _accepted_prefix(torch.where(greedy[:, None], accept, accept_sampled) & valid)  # [B]
    rejected = num_accepted < n  # [B]

    p_final = p.gather(1, num_accepted[:, None, None].expand(b, 1, vocab)).squeeze(1)  # [B, V]
    if max_drafts > 0:
        q_index = num_accepted.clamp(max=max_drafts - 1)[:, None, None].expand(b, 1, vocab)  # [B, 1, V]
        q_final = q.gather(1, q_index).squeeze(1)  # [B, V]
        residual = (p_final - q_final).clamp(min=0.0)  # [B, V]
        use_residual = rejected & (residual.sum(dim=-1) > 0)  # [B]
        dist = torch.where(use_residual[:, None], residual, p_final)  # [B, V]
    else:
        dist = p_final  # [B, V]
    u_final = u.gather(1, n[:, None]).squeeze(1)  # [B]
    sampled = sample_with_uniforms(dist, u_final)  # [B]
    final = torch.where(greedy, p_argmax.gather(1, num_accepted[:, None]).squeeze(1), sampled)  # [B]
    return _result(tokens, num_accepted, final)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Per row of ``accept [B, K]``, how many drafts are accepted before the first rejection: ``[B]``."""
    return accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _result(tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> VerifyResult:
    """Each row's accepted drafts (``tokens [B, K]`` up to ``num_accepted [B]``) followed by ``final [B]``."""
    accepted_list = num_accepted.tolist()
    outputs = [row[:k] + [t] for row, k, t in zip(tokens.tolist(), accepted_list, final.tolist())]
    return VerifyResult(num_accepted=accepted_list, output_tokens=outputs)
