"""Target-side SSD proposer: talks to the draft worker (a local process or a draft server) and survives its failure.

Each round it sends the outcome of the previous verification (k and the newly committed tokens) and gets
the next speculation back, from the worker's cache on a hit or from the fallback on a miss. If the worker
cannot start, dies, or does not answer within ``draft_timeout_s``, the client logs it once, stops the
process, and from then on proposes nothing: every accepted request finishes by plain decoding, with the
same tokens (verification with zero drafts is exactly target sampling).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from ssd.core.sequence import Sequence
from ssd.options import Fallback
from ssd.speculative.async_draft.planning.fallback_policy import FallbackPolicy
from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.async_draft.link import DraftLink, LocalDraftLink
from ssd.speculative.async_draft.worker import WorkerConfig
from ssd.speculative.proposal import DraftStatistics, Proposal, ProposalRequest, VerifiedRound
from ssd.speculative.target_features import TargetFeatureLog, head_can_draft

logger = logging.getLogger(__name__)


class DraftWorkerError(RuntimeError):
    pass


class SSDProposer:
    def __init__(
        self,
        config: WorkerConfig,
        fallback: Fallback,
        timeout_s: float,
        start_timeout_s: float = 300.0,
        build_first_round: bool = False,
        feature_layers: tuple[int, ...] | None = None,
        open_link: Callable[[], DraftLink] | None = None,
        quiet_start: bool = False,
    ) -> None:
        """``build_first_round``: the engine's prompt step emits its token without drafts, so the worker can
        build each new sequence's first-round cache while the target computes the prompt. ``feature_layers``: the
        worker runs an EAGLE-3 head, which reads the target's hidden states entering these layers; each round
        sends the features of the positions the target computed since the last. ``open_link``: reaches the draft
        (default: spawns a local worker process with ``config``); ``quiet_start``: a failure to start is not logged
        (a pool retrying a server that is down says so once itself)."""
        if feature_layers is not None and build_first_round:
            raise ValueError("an EAGLE-3 head cannot build a first round: it needs the prompt's features")
        self.config = config
        self.feature_layers = feature_layers
        self._features = TargetFeatureLog()
        self._features_sent: dict[int, int] = {}  # seq_id -> positions whose features the worker has had
        self._feature_width = 0  # F, once a step has computed features
        self.timeout_s = timeout_s
        self.build_first_round = build_first_round
        self.vocab_size = config.target_vocab_size
        self.K = config.spec.num_speculative_tokens
        self._statistics = DraftStatistics()
        self.available = True
        self.failure: str | None = None
        self._told: dict[int, int] = {}  # seq_id -> tokens the worker has been sent
        self._last_k: dict[int, int] = {}
        self._round_ids = itertools.count()
        self._fallback = FallbackPolicy(fallback)
        self._round: tuple[int, float] | None = None  # (batch size, proposal requested at) of the open round
        self._probs_buffer: np.ndarray | None = None
        self._sent: tuple[int, float] = (-1, 0.0)  # (round id, sent at) of the request awaiting its reply
        self._link: DraftLink | None = None
        try:
            try:
                self._link = (open_link or (lambda: LocalDraftLink(config)))()
            except (OSError, ValueError) as exc:  # refused, unreachable, not authenticated
                raise DraftWorkerError(f"cannot reach the draft: {exc}") from exc
            reply = self._receive(start_timeout_s)
            if isinstance(reply, wire.ErrorMsg):
                raise DraftWorkerError(reply.message)
            layers = reply.info.get("feature_layers")
            if isinstance(layers, str) and layers:  # a server's EAGLE-3 head: it reads these layers' features
                self.feature_layers = tuple(int(layer) for layer in layers.split(","))
                self.build_first_round = False  # (a head needs the prompt's features)
            sent, setup_s = self._link.hello_sent_at, reply.info.get("setup_s")
            if sent is not None and isinstance(setup_s, float):  # a session: HELLO -> READY less the server's work
                self._statistics.link_rtt_s = max(0.0, time.perf_counter() - sent - setup_s)
        except DraftWorkerError as exc:
            self._fail(str(exc), log=not quiet_start)

    # ------------------------------------------------------------------ transport
    def _receive(self, timeout: float):
        assert self._link is not None
        try:
            if not self._link.conn.poll(timeout):
                raise DraftWorkerError(f"{self._link.name} did not answer within {timeout:.1f} s")
            data = self._link.conn.recv_bytes()
            self._statistics.bytes_received += len(data)
            return wire.decode_message(data)
        except (EOFError, OSError, ValueError) as exc:
            raise DraftWorkerError(f"lost the {self._link.name}: {exc!r}") from exc

    def _send(self, msg) -> None:
        assert self._link is not None
        try:
            data = msg.pack()
            self._link.conn.send_bytes(data)
            self._statistics.bytes_sent += len(data)
        except (OSError, ValueError) as exc:
            raise DraftWorkerError(f"lost the {self._link.name}: {exc!r}") from exc

    def _fail(self, reason: str, log: bool = True) -> None:
        if self.available and log:
            logger.error("SSD draft unavailable (%s); continuing without speculation", reason)
        self.available = False
        self.failure = reason
        self._stop_process(graceful=False)

    # ------------------------------------------------------------------ proposer interface
    def prepare(self, seqs: list[Sequence]) -> None:
        """Start the draft's prefill for sequences it has not seen, while the target computes them."""
        fresh = [s for s in seqs if s.seq_id not in self._told]
        if not fresh or not self.available:
            return
        first = [self._first_round_drafts(s) for s in fresh]
        try:
            self._send(_prefill_message(fresh, first))
        except DraftWorkerError as exc:
            self._fail(str(exc))
            return
        for seq, n in zip(fresh, first):
            self._told[seq.seq_id] = seq.num_tokens
            # With a first-round cache the prompt step counts as a round of 0 drafts: its token is the bonus.
            self._last_k[seq.seq_id] = 0 if n > 0 else -1

    def _first_round_drafts(self, seq: Sequence) -> int:
        """Drafts per branch of the first-round cache the worker builds after prefilling ``seq``; 0 unless
        this step is the prompt's (a sequence re-prefilled after preemption speculates in this very step)."""
        if not self.build_first_round or seq.num_output_tokens > 0:
            return 0
        return max(0, min(self.K, seq.sampling_params.max_tokens - 2))  # the first round follows one token

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        return self.finish_round(requests) if self.begin_round(requests) else self._empty(requests)

    def begin_round(self, requests: list[ProposalRequest]) -> bool:
        """Send this round's request (the new tokens and last round's outcome of each row); False if the draft is
        unavailable. :meth:`finish_round` waits for the reply: a pool of drafts sends to all before it waits."""
        if not self.available:
            return False
        self._round = (len(requests), time.perf_counter())
        self.prepare([r.seq for r in requests])
        rows = []
        for r in requests:
            seq = r.seq
            told = self._told[seq.seq_id]
            num_drafts, tree_depth = r.num_drafts, self._tree_depth(r)
            if self.feature_layers is not None and not head_can_draft(seq):
                num_drafts = tree_depth = 0  # a prompt step that verifies: the head has no features of it yet
            rows.append((seq.seq_id, seq.token_ids[told:], self._last_k[seq.seq_id], num_drafts, tree_depth))
            self._told[seq.seq_id] = seq.num_tokens
        fallback = self._fallback.choose(len(requests))
        round_id = next(self._round_ids)
        features = None if self.feature_layers is None else [self._new_features(r.seq) for r in requests]
        try:
            msg = wire.SpeculateMsg.from_lists(round_id, *zip(*rows), target_features=features)
            msg.fallback = fallback
            self._sent = (round_id, time.perf_counter())
            self._send(msg)
        except DraftWorkerError as exc:
            self._fail(str(exc))
            return False
        return self.available  # (preparing may have failed)

    def finish_round(self, requests: list[ProposalRequest]) -> Proposal:
        """The reply to the request :meth:`begin_round` sent for ``requests``."""
        round_id, sent = self._sent
        try:
            reply = self._receive(self.timeout_s)
            waited = time.perf_counter() - sent
        except DraftWorkerError as exc:
            self._fail(str(exc))
            return self._empty(requests)
        if isinstance(reply, wire.ErrorMsg) or getattr(reply, "round_id", round_id) != round_id:
            self._fail(reply.message if isinstance(reply, wire.ErrorMsg) else "draft worker answered out of order")
            return self._empty(requests)
        if reply.batch_size != len(requests) or any(
            n > r.num_drafts for n, r in zip(reply.num_drafts.tolist(), requests)
        ):
            self._fail("draft worker answered with more rows or drafts than requested")
            return self._empty(requests)
        proposal = self._to_proposal(reply, requests)
        self._account(proposal, reply, waited)
        return proposal

    def observe_target(self, computed: list[tuple[int, int, int]], features: torch.Tensor) -> None:
        """The target's step computed, for each ``(seq_id, first position, count)`` in flat order, the rows of
        ``features [T, 3 Ht]``; the next round sends the worker those it keeps."""
        if not self.available:  # no round will send them
            return
        self._features.observe(computed, features)
        self._feature_width = features.shape[1]

    def _new_features(self, seq: Sequence) -> tuple[int, np.ndarray]:
        """The target's features of ``seq``'s positions the worker has not had, up to the pending token's
        (first position, float32 ``[m, 3 Ht]``); positions the target never computed are left out (zeros there)."""
        first, end = self._features_sent.get(seq.seq_id, 0), seq.num_computed_tokens
        span = self._features.span(seq.seq_id, first, end)
        self._features.forget(seq.seq_id, end)
        self._features_sent[seq.seq_id] = max(first, end)
        if span is None:
            return end, np.zeros((0, self._feature_width), dtype=np.float32)
        start, rows = span
        rows = rows.detach().float().cpu().numpy()
        self._statistics.feature_bytes += rows.nbytes
        return start, rows

    def _tree_depth(self, request: ProposalRequest) -> int:
        """Drafts per branch of the cache the worker builds during this round: K (so that a hit can serve
        whatever round drafts the next round chooses), fewer only when the request cannot use K more tokens."""
        seq = request.seq
        remaining = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
        return max(request.num_drafts, min(self.K, remaining))

    def _to_proposal(self, reply, requests: list[ProposalRequest]) -> Proposal:
        tokens = torch.from_numpy(reply.draft_tokens)  # [B, K]
        shape = (reply.batch_size, reply.draft_tokens.shape[1], self.vocab_size)
        if self._probs_buffer is None or self._probs_buffer.shape != shape:
            self._probs_buffer = np.empty(shape, dtype=np.float32)
        # Reused every round (megabytes at V ~ 50k; fresh pages cost more than the copy). The proposal is
        # consumed by verification before the next round overwrites it.
        probs = torch.from_numpy(reply.dense_probs(self.vocab_size, out=self._probs_buffer))  # [B, K, V]
        hits = reply.hit.tolist()
        fallbacks = reply.fallbacks()  # None where the row hit the cache
        copied = torch.from_numpy(reply.copied)  # [B, K]
        # A random filler's drafts are prompt-lookup copies (or none), not the draft model's guesses.
        informative = [kind != Fallback.RANDOM for kind in fallbacks]
        return Proposal(tokens, probs, reply.num_drafts.tolist(), hits, fallbacks, copied, informative)

    def _account(self, proposal: Proposal, reply, waited: float) -> None:
        stats = self._statistics
        stats.rounds += 1
        stats.reply_wait_s += waited
        stats.serve_s += reply.serve_s
        stats.build_time_s += reply.cache_build_s
        stats.build_branches += reply.cache_branches
        stats.builds += int(reply.cache_branches > 0)
        stats.builds_cut_short += reply.cache_cut_short

    def statistics(self) -> DraftStatistics:
        return self._statistics

    def _empty(self, requests: list[ProposalRequest]) -> Proposal:
        """No drafts for any row (the worker is unavailable): plain decoding, no cache lookup."""
        b = len(requests)
        return Proposal(torch.zeros(b, 1, dtype=torch.long), torch.zeros(b, 1, self.vocab_size), [0] * b)

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        if self._round is not None:
            batch_size, started = self._round
            self._fallback.observe_round(batch_size, sum(len(r.output_tokens) for r in rounds),
                                         time.perf_counter() - started)
            self._round = None
        for r in rounds:
            if r.seq.seq_id in self._last_k:
                self._last_k[r.seq.seq_id] = r.num_accepted

    def release(self, seq: Sequence) -> None:
        if self._told.pop(seq.seq_id, None) is None:
            return
        self._last_k.pop(seq.seq_id, None)
        self._features.release(seq.seq_id)
        self._features_sent.pop(seq.seq_id, None)
        if self.available:
            try:
                self._send(wire.ReleaseMsg(seq_ids=np.array([seq.seq_id], dtype=np.int64)))
            except DraftWorkerError as exc:
                self._fail(str(exc))

    def shutdown(self) -> None:
        if self._link is None:
            return
        if self.available and self._link.alive():
            try:
                self._send(wire.ShutdownMsg())
            except DraftWorkerError:
                pass
        self._stop_process()

    def _stop_process(self, graceful: bool = True) -> None:
        """``graceful``: the worker was told to shut down, so give it time to exit; else end it at once."""
        link, self._link = self._link, None
        if link is not None:
            link.stop(graceful)

    @property
    def pid(self) -> int | None:
        """The local worker process's id (None for a draft server, or once stopped)."""
        return None if self._link is None else self._link.pid


def _prefill_message(seqs: list[Sequence], first_round_drafts: list[int]) -> wire.PrefillMsg:
    params = [s.sampling_params for s in seqs]
    return wire.PrefillMsg.from_lists(
        [s.seq_id for s in seqs],
        [s.token_ids for s in seqs],
        [p.temperature for p in params],
        [max(p.top_k, 0) for p in params],
        [p.top_p for p in params],
        [p.is_greedy for p in params],
        [p.seed for p in params],
        first_round_drafts,
        [s.num_prompt_tokens for s in seqs],
        [None if p.structured_outputs is None else p.structured_outputs.to_json() for p in params],
    )
