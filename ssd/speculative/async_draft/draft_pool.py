"""SSD with its draft on one or more draft servers: sequences spread over them, moved off a server that fails, and
a failed server tried again in the background until it rejoins.

Each server holds a session (an :class:`SSDProposer` over a remote link) for the sequences assigned to it and
builds their speculation caches, so the cache grows with the number of servers (the reference engine's draft
data parallelism). A new sequence goes to the available server with the fewest. A round sends every server its
rows before it waits for any reply, so the servers serve in parallel. When a server fails (dies, stalls past
``draft_timeout_s``, refuses), its sequences are reassigned to the others, which prefill them from their tokens
and speculate for them from their next round; with no server left every sequence decodes plainly (the same
tokens: verification with no drafts is target sampling). Every ``draft_rejoin_s`` a failed server is
reconnected in a background thread, so the engine never waits for it; once its session is ready it takes new
sequences again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from ssd.core.sequence import Sequence
from ssd.speculative.async_draft.client import SSDProposer
from ssd.speculative.proposal import DraftStatistics, Proposal, ProposalRequest, VerifiedRound

logger = logging.getLogger(__name__)


class _Member:
    """One draft server: its current session (None while it is down) and its reconnection."""

    def __init__(self, url: str, connect: Callable[[bool], SSDProposer]) -> None:
        self.url = url
        self.connect = connect
        self.session: SSDProposer | None = None
        self.retired = DraftStatistics()  # counters of its failed sessions
        self.failed_at = 0.0
        self.reconnecting: threading.Thread | None = None
        self.pending: SSDProposer | None = None  # a reconnection's session, adopted by the engine's thread

    @property
    def up(self) -> bool:
        return self.session is not None and self.session.available


class DraftServerPool:
    """A proposer over draft servers (one or more), with the interface of :class:`SSDProposer`."""

    def __init__(self, urls: list[str], connect: Callable[[str, bool], SSDProposer], rejoin_s: float,
                 vocab_size: int) -> None:
        """``connect(url, retry)``: a session with the server at ``url`` (``retry``: a reconnection, whose failure
        is not logged again); ``vocab_size``: the target's (the width of the draft distributions)."""
        self.rejoin_s = rejoin_s
        self.vocab_size = vocab_size
        self._owner: dict[int, _Member] = {}  # seq_id -> the server drafting for it
        self._last_reason: str | None = None  # why the last server that failed did
        self._outage_logged = False  # "no server available" said once per outage
        self._closed = False  # shut down: reconnections that finish later end their sessions
        self._closing = threading.Lock()  # orders a reconnection's adoption against the shutdown
        self.members = [_Member(url, lambda retry, url=url: connect(url, retry)) for url in urls]
        for member in self.members:
            member.session = member.connect(False)
        for member in self.members:
            if not member.up:
                self._lost(member)

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The target layers whose features the servers' EAGLE-3 heads read (None: draft models); the step
        computes them with its forward and hands them to :meth:`observe_target`."""
        return next((m.session.feature_layers for m in self.members if m.up and m.session.feature_layers), None)

    def observe_target(self, computed: list[tuple[int, int, int]], features: torch.Tensor) -> None:
        """Each server gets the features of its own sequences' rows (``computed``: (seq_id, first position,
        rows) in the flat order of ``features``' rows)."""
        parts: dict[int, tuple[_Member, list, list[torch.Tensor]]] = {}
        row = 0
        for seq_id, first, count in computed:
            member = self._owner.get(seq_id)
            if member is not None and member.up:
                part = parts.setdefault(id(member), (member, [], []))
                part[1].append((seq_id, first, count))
                part[2].append(features[row : row + count])
            row += count
        for member, entries, rows in parts.values():
            member.session.observe_target(entries, torch.cat(rows))

    # ------------------------------------------------------------------ availability
    @property
    def available(self) -> bool:
        return any(m.up for m in self.members)

    @property
    def failure(self) -> str | None:
        """Why the last server that failed did (None while every server is up)."""
        return None if all(m.up for m in self.members) else self._last_reason

    def _lost(self, member: _Member) -> None:
        """A member's session failed (its client logged why): its sequences move to the others."""
        if member.session is not None:
            self._last_reason = member.session.failure
            _add(member.retired, member.session.statistics())
            member.session.shutdown()
        member.session = None
        member.failed_at = time.monotonic()
        for seq_id in [s for s, m in self._owner.items() if m is member]:
            del self._owner[seq_id]  # reassigned at its next round; the new server prefills it
        if not self.available and len(self.members) > 1 and not self._outage_logged:  # (each session's client
            self._outage_logged = True  # logged its own failure)
            logger.error("no SSD draft server available; decoding without speculation until one rejoins")

    def _check_members(self) -> None:
        """Adopt sessions that reconnected; start reconnecting members that have been down long enough."""
        now = time.monotonic()
        for member in self.members:
            if member.session is not None and not member.session.available:
                self._lost(member)
            if member.pending is not None:  # a reconnection finished
                session, member.pending = member.pending, None
                if session.available:
                    member.session = session
                    self._outage_logged = False
                    logger.warning("SSD draft server %s rejoined", member.url)
                else:  # still down: try again later, quietly
                    _add(member.retired, session.statistics())
                    member.failed_at = time.monotonic()
            elif (member.session is None and self.rejoin_s > 0 and now - member.failed_at >= self.rejoin_s
                  and member.reconnecting is None):
                member.reconnecting = threading.Thread(target=self._reconnect, args=(member,),
                                                       name="ssd-draft-rejoin", daemon=True)
                member.reconnecting.start()

    def _reconnect(self, member: _Member) -> None:
        try:
            session = member.connect(True)
            with self._closing:
                adopt = not self._closed
                if adopt:
                    member.pending = session
            if not adopt:  # the engine shut down meanwhile: nobody adopts it
                session.shutdown()
        finally:
            member.failed_at = time.monotonic()
            member.reconnecting = None

    def _assign(self, seq: Sequence) -> _Member | None:
        member = self._owner.get(seq.seq_id)
        if member is not None and member.up:
            return member
        up = [m for m in self.members if m.up]
        if not up:
            return None
        load = {id(m): 0 for m in up}
        for owner in self._owner.values():
            if id(owner) in load:
                load[id(owner)] += 1
        member = min(up, key=lambda m: load[id(m)])
        self._owner[seq.seq_id] = member
        return member

    def _split(self, items: list, seq_of: Callable, assign: bool = True) -> dict[int, tuple[_Member, list[int]]]:
        """Positions of ``items`` by the member drafting for each (members that are down get none); ``assign``:
        sequences without a member that is up get one."""
        groups: dict[int, tuple[_Member, list[int]]] = {}
        for i, item in enumerate(items):
            seq = seq_of(item)
            member = self._assign(seq) if assign else self._owner.get(seq.seq_id)
            if member is not None and member.up:
                groups.setdefault(id(member), (member, []))[1].append(i)
        return groups

    # ------------------------------------------------------------------ proposer interface
    def prepare(self, seqs: list[Sequence]) -> None:
        self._check_members()
        for member, rows in self._split(seqs, lambda s: s).values():
            member.session.prepare([seqs[i] for i in rows])

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        self._check_members()
        groups = list(self._split(requests, lambda r: r.seq).values())
        began = [(member, rows, member.session.begin_round([requests[i] for i in rows])) for member, rows in groups]
        parts = []
        for member, rows, sent in began:  # every server has its request before the first reply is awaited
            sub = [requests[i] for i in rows]
            parts.append((rows, member.session.finish_round(sub) if sent else member.session.propose(sub)))
        return _merge(parts, len(requests), self.vocab_size)

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        for member, rows in self._split(rounds, lambda r: r.seq, assign=False).values():
            member.session.on_verified([rounds[i] for i in rows])

    def release(self, seq: Sequence) -> None:
        member = self._owner.pop(seq.seq_id, None)
        if member is not None and member.session is not None:
            member.session.release(seq)

    def statistics(self) -> DraftStatistics:
        total = DraftStatistics()
        for member in self.members:
            _add(total, member.retired)
            if member.session is not None:
                _add(total, member.session.statistics())
        return total

    def shutdown(self) -> None:
        """End every session; a reconnection still waiting for its server (up to its start timeout) ends its
        session itself when it returns, so shutting down never waits for a server that does not answer."""
        with self._closing:
            self._closed = True
        self.rejoin_s = 0.0  # no new reconnections
        for member in self.members:
            reconnecting = member.reconnecting
            if reconnecting is not None:
                reconnecting.join(timeout=1.0)
            for session in (member.session, member.pending):
                if session is not None:
                    session.shutdown()
            member.session = member.pending = None

    @property
    def pid(self) -> int | None:
        return None


def _merge(parts: list[tuple[list[int], Proposal]], batch: int, vocab: int) -> Proposal:
    """One proposal from the servers' proposals for their rows (``rows``: positions in the batch); rows no
    server drafted for get no drafts."""
    if len(parts) == 1 and len(parts[0][0]) == batch:
        return parts[0][1]
    width = max([p.draft_tokens.shape[1] for _, p in parts], default=1)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    probs = torch.zeros(batch, width, vocab)
    copied = torch.zeros(batch, width, dtype=torch.bool)
    num_drafts, informative = [0] * batch, [True] * batch
    hits: list[bool | None] = [None] * batch  # None: no lookup (no server drafted for the row)
    fallbacks: list = [None] * batch
    for rows, p in parts:
        index = torch.tensor(rows)
        k = p.draft_tokens.shape[1]
        tokens[index, :k] = p.draft_tokens
        probs[index, :k] = p.draft_probs
        if p.copied is not None:
            copied[index, :k] = p.copied
        for j, row in enumerate(rows):
            num_drafts[row] = p.num_drafts[j]
            origin = p.origin(j)
            hits[row] = origin.cache_hit
            fallbacks[row] = origin.fallback
            informative[row] = origin.informative
    return Proposal(tokens, probs, num_drafts, hits, fallbacks, copied, informative)  # type: ignore[arg-type]


def _add(total: DraftStatistics, part: DraftStatistics) -> None:
    """Counters add up; the link's round trip is the slowest server's."""
    for name, value in vars(part).items():
        if name == "link_rtt_s":
            if value is not None:
                total.link_rtt_s = value if total.link_rtt_s is None else max(total.link_rtt_s, value)
        else:
            setattr(total, name, getattr(total, name) + value)
