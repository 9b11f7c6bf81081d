"""SSD with its draft on a draft server (``ssd draft-serve``) over loopback TCP: exact greedy tokens, and every
fault (server killed, stalled, busy, wrong token, foreign protocol, unfit vocabulary) leaves the engine decoding
on with the same tokens, the reason logged once."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3_utils import make_test_pairs
from remote_utils import ServerProcess, proc_stat
from ssd import LLM, SamplingParams
from ssd.speculative.async_draft.remote.channel import (
    AuthenticationError,
    SocketChannel,
    authenticate,
    connect,
)
from ssd.options import parse_draft_url
from ssd.speculative.async_draft.remote.session import SessionSettings
from ssd.speculative.async_draft.wire import protocol as wire
from ssd_utils import make_perturbed_draft

BASE = dict(dtype="float32", block_size=16, max_model_len=160, seed=0, kv_cache_memory="16MiB")
TOKEN = b"test-token-" + os.urandom(8).hex().encode()
UNAVAILABLE = "SSD draft unavailable"


def _prompts(n: int = 8) -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 500, (int(length),), generator=gen).tolist() for length in (1, 5, 17, 30, 3, 9, 40, 12)[:n]]


PROMPTS = _prompts()
GREEDY = [SamplingParams(temperature=0.0, max_tokens=16 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def pair(checkpoint_factory, tmp_path_factory):
    target = checkpoint_factory()
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("remote") / "draft", 0.04)
    with LLM(str(target), **BASE) as ar:
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    return target, draft, expected


@pytest.fixture(scope="module")
def server(pair):
    proc = ServerProcess(pair[1], TOKEN)
    yield proc
    assert proc.stop() == 0  # a graceful shutdown: SIGTERM ends the server cleanly
    assert not proc.process.is_alive()


def _remote(target: Path, url: str, token: bytes = TOKEN, **spec) -> LLM:
    return LLM(str(target), max_num_seqs=8, **BASE,
               speculative_config={"method": "ssd", "draft_url": url, "draft_token": token.decode(), **spec})


def _generate_exact(llm: LLM, expected: list[list[int]]):
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    return outputs


def _socket_fds() -> set[str]:
    """This process's open sockets."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _unavailable_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNAVAILABLE in r.getMessage()]


# ------------------------------------------------------------------------------------------------ channel


def _channel_pair() -> tuple[SocketChannel, SocketChannel]:
    a, b = socket.socketpair()
    return SocketChannel(a), SocketChannel(b)


def test_channel_frames_messages_of_every_size():
    left, right = _channel_pair()
    messages = [b"", b"x", os.urandom(70_000), os.urandom(3 << 20)]
    echo = threading.Thread(target=lambda: [right.send_bytes(right.recv_bytes()) for _ in messages])
    echo.start()
    for msg in messages:
        left.send_bytes(msg)
        assert left.poll(10)
        assert bytes(left.recv_bytes()) == msg
    echo.join()
    right.close()
    assert left.poll(1)  # the close is readable ...
    with pytest.raises(EOFError):  # ... and reads as the end of the stream between messages
        left.recv_bytes()
    left.close()


@pytest.mark.parametrize("server_token, client_token", [(b"same", b"same"), (b"one", b"other")])
def test_authentication_is_mutual(server_token, client_token):
    left, right = _channel_pair()
    errors: list[Exception] = []

    def serve() -> None:
        try:
            authenticate(right, server_token, server=True, timeout_s=5)
        except AuthenticationError as exc:
            errors.append(exc)
            right.close()

    thread = threading.Thread(target=serve)
    thread.start()
    if server_token == client_token:
        authenticate(left, client_token, server=False, timeout_s=5)
    else:
        with pytest.raises(AuthenticationError, match="does not know the shared token"):
            authenticate(left, client_token, server=False, timeout_s=5)
    thread.join()
    assert len(errors) == (server_token != client_token)
    left.close()
    right.close()


def test_draft_urls_and_remote_options_are_checked(pair):
    assert parse_draft_url("tcp://10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_draft_url("tcp://[::1]:7000") == ("::1", 7000)
    for bad in ("http://host:1", "tcp://host", "tcp://host:0", "host:7000", "tcp://host:7000/x"):
        with pytest.raises(ValueError, match="draft_url"):
            parse_draft_url(bad)
    target, draft, _ = pair
    url = "tcp://127.0.0.1:9"
    with pytest.raises(ValueError, match="draft server chooses model"):
        LLM(str(target), **BASE, speculative_config={"method": "ssd", "draft_url": url, "model": str(draft)})
    with pytest.raises(ValueError, match="needs method 'ssd'"):
        LLM(str(target), **BASE, speculative_config={"method": "draft_model", "draft_url": url})
    env = os.environ.pop("SSD_DRAFT_TOKEN", None)
    try:
        with pytest.raises(ValueError, match="shared token"):
            LLM(str(target), **BASE, speculative_config={"method": "ssd", "draft_url": url})
    finally:
        if env is not None:
            os.environ["SSD_DRAFT_TOKEN"] = env


def test_session_settings_round_trip():
    settings = SessionSettings(engine_options={"block_size": 16, "seed": 3}, spec_options={"fan_out": "1,2,3"},
                               max_model_len=160, num_blocks=90, target_vocab_size=512, target_tokens=500,
                               vocab_digest="ab", max_num_seqs=8, target_hidden_size=64, target_num_layers=2,
                               graphs={"max_query_len": 5, "max_kv_len": 200, "compile": False,
                                                          "capture": True})
    assert SessionSettings.from_json(settings.to_json()) == settings
    with pytest.raises(ValueError, match="malformed session settings"):
        SessionSettings.from_json('{"engine_options": {}}')


def test_merged_proposals_keep_each_row_where_it_was():
    """The pool's rows come back from different servers (of different widths) and one row from none."""
    from ssd.options import Fallback
    from ssd.speculative.async_draft.draft_pool import _merge
    from ssd.speculative.proposal import Proposal

    vocab = 7
    a = Proposal(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.rand(2, 3, vocab), [3, 1], [True, False],
                 [None, Fallback.JIT], torch.tensor([[False, True, False], [True, False, False]]), [True, True])
    b = Proposal(torch.tensor([[6]]), torch.rand(1, 1, vocab), [1], [False], [Fallback.RANDOM],
                 torch.tensor([[False]]), [False])
    merged = _merge([([2, 0], a), ([3], b)], batch=4, vocab=vocab)
    assert merged.draft_tokens.tolist() == [[4, 5, 6], [0, 0, 0], [1, 2, 3], [6, 0, 0]]
    assert merged.num_drafts == [1, 0, 3, 1]
    assert torch.equal(merged.draft_probs[2], a.draft_probs[0]) and torch.equal(merged.draft_probs[3, :1],
                                                                                b.draft_probs[0])
    assert not merged.draft_probs[1].any()
    assert [merged.origin(i).cache_hit for i in range(4)] == [False, None, True, False]  # row 1: no lookup
    assert [merged.origin(i).fallback for i in range(4)] == [Fallback.JIT, None, None, Fallback.RANDOM]
    assert [merged.origin(i).informative for i in range(4)] == [True, True, True, False]
    assert merged.copied[2].tolist() == [False, True, False]


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=3, fallback="jit"),
                                  dict(num_speculative_tokens=4, fallback="random", fan_out="auto"),
                                  dict(num_speculative_tokens=2, prompt_step_speculation=True)],
                         ids=["k3-jit", "k4-random-auto", "k2-prompt-step"])
def test_remote_draft_greedy_equals_ar(pair, server, spec, caplog):
    target, _, expected = pair
    sockets = _socket_fds()
    with _remote(target, server.url, **spec) as llm:
        outputs = _generate_exact(llm, expected)
        assert llm.engine.proposer.available and llm.engine.proposer.pid is None
        stats = llm.stats
        assert stats.cache_lookups > 0 and 0 < stats.cache_hits <= stats.cache_lookups
        assert stats.num_accepted_tokens > 0 and stats.draft_builds > 0
        # per-round accounting: every answered request timed, the draft's serving a part of the wait
        assert stats.draft_rounds > 0
        assert 0 < stats.draft_serve_s < stats.draft_reply_wait_s
        assert stats.draft_link_time_s == pytest.approx(stats.draft_reply_wait_s - stats.draft_serve_s)
        assert stats.draft_bytes_sent > 0 and stats.draft_bytes_received > 0
        assert stats.draft_link_rtt_s is not None and 0 <= stats.draft_link_rtt_s < 1.0
        assert sum(o.spec_stats.num_drafts for o in outputs) > 0
        one = llm.generate([PROMPTS[3]], [GREEDY[3]])  # batch 1
        assert one[0].token_ids == expected[3]
    assert not _unavailable_logs(caplog)
    assert _socket_fds() == sockets  # the engine's shutdown closed its link ...
    deadline = time.monotonic() + 10
    while server.session_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.session_pids()  # ... and the session's process ended with it


def test_engines_share_a_server_within_its_sequence_bound(pair, server, caplog):
    """Two engines at once, each with its own session (sequences, draft KV, cache): both exact and both served
    from their caches. A third would pass the server's bound of 16 sequences: refused with the reason, it
    decodes plainly with the same tokens; once one engine leaves, the next is served."""
    target, _, expected = pair
    with _remote(target, server.url) as first, _remote(target, server.url) as second:
        with _remote(target, server.url) as third:
            assert not third.engine.proposer.available
            assert "draft server full: it serves at most 16 sequences, 16 are taken" in third.engine.proposer.failure
            _generate_exact(third, expected)
        threads = [threading.Thread(target=_generate_exact, args=(llm, expected)) for llm in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for llm in (first, second):
            assert llm.engine.proposer.available and llm.stats.cache_hits > 0
    assert len(_unavailable_logs(caplog)) == 1
    with _remote(target, server.url) as fourth:
        _generate_exact(fourth, expected)
        assert fourth.engine.proposer.available and fourth.stats.cache_hits > 0


def test_wrong_token_is_refused_before_any_message(pair, server, caplog):
    target, _, expected = pair
    with _remote(target, server.url, token=b"not-the-token") as llm:
        assert not llm.engine.proposer.available
        assert "token" in llm.engine.proposer.failure or "closed" in llm.engine.proposer.failure
        _generate_exact(llm, expected)
        assert llm.stats.cache_lookups == 0
    assert len(_unavailable_logs(caplog)) == 1


def test_foreign_protocol_version_is_refused_with_the_reason(server):
    channel = connect(server.url, TOKEN, timeout_s=10)
    hello = bytearray(wire.HelloMsg("{}").pack())
    hello[4:6] = (wire.PROTOCOL_VERSION + 1).to_bytes(2, "little")  # the frame's version field
    channel.send_bytes(bytes(hello))
    reply = wire.decode_message(channel.recv_bytes())
    assert isinstance(reply, wire.ErrorMsg)
    assert f"protocol version {wire.PROTOCOL_VERSION + 1} is not supported" in reply.message
    channel.close()


def test_a_target_with_another_vocabulary_is_refused(checkpoint_factory, server):
    other = checkpoint_factory(vocab_size=259)
    prompts = [[5, 6, 7], [9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(other), **BASE) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, params)]
    with _remote(other, server.url) as llm:
        assert not llm.engine.proposer.available
        assert "tokenizers differ" in llm.engine.proposer.failure
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


# ------------------------------------------------------------------------------------------------ faults


@pytest.fixture
def own_server(pair):
    proc = ServerProcess(pair[1], TOKEN)
    yield proc
    proc.kill()


def test_killed_server_mid_run_loses_no_request(pair, own_server, caplog):
    target, _, expected = pair
    caplog.set_level(logging.ERROR)
    with _remote(target, own_server.url) as llm:
        _generate_exact(llm, expected)
        (session,) = own_server.session_pids()
        own_server.kill()  # SIGKILL: the session's process follows its server within a second
        _wait_gone(session)
        _generate_exact(llm, expected)
        assert not llm.engine.proposer.available
    assert len(_unavailable_logs(caplog)) == 1


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"  # not a zombie


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_stalled_server_is_given_up_after_the_timeout(pair, own_server, caplog):
    target, _, expected = pair
    with _remote(target, own_server.url, draft_timeout_s=2.0) as llm:
        _generate_exact(llm, expected)
        (session,) = own_server.session_pids()
        os.kill(session, signal.SIGSTOP)
        try:
            _generate_exact(llm, expected)
        finally:
            os.kill(session, signal.SIGCONT)
        assert not llm.engine.proposer.available
        assert "did not answer within 2.0 s" in llm.engine.proposer.failure
    assert len(_unavailable_logs(caplog)) == 1
    assert own_server.stop() == 0  # the server shuts down cleanly, its sessions with it
    assert not own_server.session_pids()


def test_a_dropped_link_is_restored(pair, own_server, caplog):
    """The session's process dies (its socket closes under the engine): the engine decodes on plainly, reconnects
    after draft_rejoin_s in the background, and speculates again from the new session's caches."""
    target, _, expected = pair
    with _remote(target, own_server.url, draft_rejoin_s=0.3, adaptive_lookahead=False) as llm:
        pool = llm.engine.proposer
        _generate_exact(llm, expected)
        (session,) = own_server.session_pids()
        os.kill(session, signal.SIGKILL)
        _generate_exact(llm, expected)
        deadline = time.monotonic() + 60
        while not (pool.available and pool.members[0].session.statistics().rounds) and time.monotonic() < deadline:
            llm.generate([PROMPTS[0]], [GREEDY[0]])
            time.sleep(0.1)
        hits = llm.stats.cache_hits
        _generate_exact(llm, expected)
        assert pool.available and llm.stats.cache_hits > hits
        assert own_server.session_pids() != [session]
    assert len(_unavailable_logs(caplog)) == 1  # the drop; the reconnection says it rejoined
    assert len([m for m in caplog.messages if "rejoined" in m]) == 1


# ------------------------------------------------------------------------------------------------ several servers


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_two_servers_share_the_sequences_and_take_over_from_each_other(pair, caplog):
    """Sequences are spread over two servers (both build caches and serve hits); when one is killed its
    sequences move to the other, which prefills them and speculates for them; restarted on its port, the
    killed one rejoins in the background and takes sequences again. Every output equals AR."""
    target, draft, expected = pair
    first, second = ServerProcess(draft, TOKEN), ServerProcess(draft, TOKEN)
    try:
        with _remote(target, f"{first.url},{second.url}", draft_rejoin_s=0.5) as llm:
            pool = llm.engine.proposer
            _generate_exact(llm, expected)
            sessions = [m.session.statistics() for m in pool.members]
            assert all(s.rounds > 0 and s.builds > 0 for s in sessions)  # both drafted
            assert llm.stats.cache_hits > 0
            (session,) = first.session_pids()
            first.kill()  # its session's process follows within a second
            _wait_gone(session)
            _generate_exact(llm, expected)  # the first server's rows come back empty once, then move over
            assert pool.available and not pool.members[0].up and pool.members[1].up
            hits = llm.stats.cache_hits
            _generate_exact(llm, expected)  # every sequence on the second server
            assert llm.stats.cache_hits > hits
            first = ServerProcess(draft, TOKEN, port=_port(pool.members[0].url))
            deadline = time.monotonic() + 60
            while not pool.members[0].up and time.monotonic() < deadline:
                llm.generate([PROMPTS[0]], [GREEDY[0]])  # rounds adopt the reconnected session
                time.sleep(0.2)
            assert pool.members[0].up
            before = pool.members[0].session.statistics().rounds
            _generate_exact(llm, expected)
            assert pool.members[0].session.statistics().rounds > before  # it drafts again
        assert len([m for m in caplog.messages if "rejoined" in m]) == 1
    finally:
        first.kill()
        second.kill()


def test_an_eagle3_head_on_a_server_drafts_from_the_engines_features(checkpoint_factory, tmp_path_factory, caplog):
    """A server running an EAGLE-3 head (with --target, the target it drafts for) tells the engine which layers'
    features it reads; the engine sends them each round, and the head, which agrees with this target, has every
    draft accepted. An engine running another target is refused with the reason."""
    paths = make_test_pairs(checkpoint_factory, tmp_path_factory.mktemp("remote_head"))
    target, head = Path(paths["constant"]), Path(paths["agreeing_head"])
    with LLM(str(target), **BASE) as ar:
        expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    server = ServerProcess(head, TOKEN, target=target)
    try:
        with _remote(target, server.url, adaptive_lookahead=False) as llm:
            _generate_exact(llm, expected)
            stats = llm.stats
            assert llm.engine.proposer.feature_layers is not None
            assert stats.draft_feature_bytes > 0 and stats.cache_hits > 0
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        other = checkpoint_factory(vocab_size=259)
        with _remote(other, server.url) as llm:
            assert not llm.engine.proposer.available
            assert "is not the head's target" in llm.engine.proposer.failure
    finally:
        server.kill()
