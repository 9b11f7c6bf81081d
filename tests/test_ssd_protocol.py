"""SSD wire protocol: exact round trips of every message, decode errors, and a real multiprocessing Pipe."""

import json
import multiprocessing
import struct
import threading

import numpy as np
import pytest

from ssd.options import Fallback
from ssd.speculative.async_draft.wire.protocol import (
    PROTOCOL_VERSION,
    Command,
    ErrorMsg,
    FALLBACK_CODES,
    PrefillMsg,
    ProtocolError,
    HelloMsg,
    ReadyMsg,
    ReleaseMsg,
    ShutdownMsg,
    SpeculateMsg,
    SpeculationMsg,
    decode_frame,
    decode_message,
    encode_fallbacks,
    encode_frame,
    recv_message,
    scatter_prob_rows,
    send_message,
)
from ssd.structured.spec import StructuredOutputs


def _prefill() -> PrefillMsg:
    return PrefillMsg.from_lists(
        seq_ids=[3, 11, 12],
        token_ids=[[1, 2, 3], [], [2**40, 7]],
        temperature=[0.0, 0.7, 1.3],
        top_k=[0, 50, 1],
        top_p=[1.0, 0.9, 0.5],
        greedy=[True, False, False],
        seeds=[None, 2**64 - 1, 0],
        first_round_drafts=[0, 4, 2],
        num_prompt_tokens=[2, 0, 1],
        constraints=[StructuredOutputs(regex="[0-9]+").to_json(), None, StructuredOutputs(choice=["é", "b"]).to_json()],
    )


def _speculation(B=3, K=4, V=11, rows=(2, 0), seed=0) -> SpeculationMsg:
    rng = np.random.default_rng(seed)
    probs = rng.random((len(rows), K, V), dtype=np.float32)
    hit = np.zeros(B, dtype=bool)
    fallbacks = [Fallback.JIT] * B
    if B:
        hit[0] = True
        fallbacks[0] = None
    if B > 2:
        fallbacks[2] = Fallback.RANDOM
    fallback = encode_fallbacks(fallbacks)
    return SpeculationMsg(
        round_id=2**40 + 5,
        draft_tokens=rng.integers(0, V, (B, K)),
        hit=hit,
        fallback=fallback,
        prob_rows=np.asarray(rows, dtype=np.int32),
        probs=probs,
        cache_build_s=0.0123,
        cache_branches=37,
        cache_cut_short=1,
        serve_s=1e-4,
    )


def _assert_arrays_equal(a, b, names):
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert np.array_equal(x, y), name


# ------------------------------------------------------------------------------------------------
# round trips


def test_prefill_round_trip_ragged_and_seeds():
    msg = _prefill()
    out = decode_message(msg.pack())
    assert isinstance(out, PrefillMsg)
    _assert_arrays_equal(msg, out, PrefillMsg.ARRAYS)
    assert out.batch_size == 3
    assert [t.tolist() for t in out.token_lists()] == [[1, 2, 3], [], [2**40, 7]]
    assert [out.seed_of(i) for i in range(3)] == [None, 2**64 - 1, 0]
    assert out.temperature.dtype == np.float32 and out.top_k.dtype == np.int32
    assert out.greedy.tolist() == [True, False, False]
    assert PrefillMsg.unpack(msg.pack()).lengths.tolist() == [3, 0, 2]
    assert out.num_prompt_tokens.tolist() == [2, 0, 1]
    texts = out.constraint_texts()
    assert texts[1] is None and StructuredOutputs.from_json(texts[0]) == StructuredOutputs(regex="[0-9]+")
    assert StructuredOutputs.from_json(texts[2]) == StructuredOutputs(choice=("é", "b"))  # UTF-8 intact


def test_speculate_round_trip():
    msg = SpeculateMsg.from_lists(
        round_id=17, seq_ids=[5, 6], new_token_ids=[[9, 8, 7, 6], [4]], num_accepted=[3, -1],
        num_drafts=[4, 2], tree_depth=[4, 3],
    )
    out = decode_message(msg.pack())
    assert isinstance(out, SpeculateMsg) and out.round_id == 17 and out.batch_size == 2
    _assert_arrays_equal(msg, out, SpeculateMsg.ARRAYS)
    assert [t.tolist() for t in out.new_token_lists()] == [[9, 8, 7, 6], [4]]
    assert out.num_accepted.tolist() == [3, -1] and out.num_drafts.dtype == np.int32
    assert out.tree_depth.tolist() == [4, 3] and out.tree_depth.dtype == np.int32
    # without a tree depth the next cache prepares as many drafts as this round asks for
    assert SpeculateMsg.from_lists(0, [5], [[1]], [0], [2]).tree_depth.tolist() == [2]
    assert out.fallback is Fallback.JIT
    msg.fallback = Fallback.RANDOM  # the client sets the batch's fallback after building
    assert decode_message(msg.pack()).fallback is Fallback.RANDOM
    assert out.target_features() == [None, None]  # a draft model's rounds carry no features


def test_speculate_carries_an_eagle3_heads_target_features():
    rows = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)  # [positions, F]
    msg = SpeculateMsg.from_lists(2, [5, 6, 7], [[9, 8, 7], [4], [3]], [2, -1, 0], [3, 3, 0],
                                  target_features=[(10, rows[:3]), (0, rows[3:]), (4, rows[:0])])
    out = decode_message(msg.pack())
    got = out.target_features()
    assert got[0][0] == 10 and np.array_equal(got[0][1], rows[:3]) and got[1][0] == 0
    assert np.array_equal(got[1][1], rows[3:]) and got[2] is None and out.features.dtype == np.float32
    arrays = {name: getattr(msg, name) for name in SpeculateMsg.ARRAYS} | {"feature_lengths": np.array([3, 1, 0])}
    with pytest.raises(ProtocolError, match="feature_lengths sums to 4 but SpeculateMsg.features has 5 rows"):
        SpeculateMsg(round_id=2, **arrays)
    msg.fallback = Fallback.AUTO  # a policy that picks a fallback, not one: refused when the message is read
    with pytest.raises(ProtocolError, match="fallback must be one of"):
        decode_message(msg.pack())


def test_speculation_round_trip_with_some_prob_rows():
    msg = _speculation(rows=(2, 0))
    out = decode_message(msg.pack())
    assert isinstance(out, SpeculationMsg)
    _assert_arrays_equal(msg, out, SpeculationMsg.ARRAYS)
    assert out.round_id == 2**40 + 5 and out.cache_build_s == 0.0123 and out.serve_s == 1e-4
    assert out.cache_branches == 37 and out.cache_cut_short == 1
    assert out.hit.tolist() == [True, False, False]
    assert out.fallbacks() == [None, Fallback.JIT, Fallback.RANDOM]
    assert out.fallback.tolist() == [FALLBACK_CODES[f] for f in (None, Fallback.JIT, Fallback.RANDOM)]
    assert out.num_drafts.tolist() == [4, 4, 4]  # none given: every row holds K drafts
    dense = out.dense_probs()
    assert dense.shape == (3, 4, 11) and dense.dtype == np.float32 and dense.flags.writeable
    assert np.array_equal(dense[2], msg.probs[0])
    assert np.array_equal(dense[0], msg.probs[1])
    assert not dense[1].any()


def test_speculation_without_prob_rows_needs_vocab_size():
    msg = _speculation(rows=())
    out = decode_message(msg.pack())
    assert out.probs.shape == (0, 4, 11) and out.prob_rows.shape == (0,)
    with pytest.raises(ProtocolError, match="vocab_size"):
        out.dense_probs()
    dense = out.dense_probs(vocab_size=5)
    assert dense.shape == (3, 4, 5) and not dense.any()
    # an empty probs array of any [0, ?, V] shape is accepted and normalised to K
    loose = SpeculationMsg(7, np.zeros((2, 3), np.int64), [False, False], [1, 2], [], np.zeros((0, 0, 0)))
    assert loose.probs.shape == (0, 3, 0)


def test_speculation_rows_may_hold_fewer_drafts():
    """A random filler can be shorter than K (only what prompt lookup copies): per-row counts travel."""
    msg = _speculation()
    msg.num_drafts = np.array([4, 1, 0], np.int32)
    out = decode_message(msg.pack())
    assert out.num_drafts.dtype == np.int32 and out.num_drafts.tolist() == [4, 1, 0]
    for counts, match in (([5, 0, 0], r"num_drafts must lie in \[0, K=4\]"), ([-1, 0, 0], "must lie in"),
                          ([1, 1], "rows, expected 3")):
        bad = _speculation()
        bad.num_drafts = np.array(counts, np.int32)
        with pytest.raises(ProtocolError, match=match):
            decode_message(bad.pack())


def test_cut_short_flag_is_zero_or_one():
    bad = _speculation()
    bad.cache_cut_short = 2
    with pytest.raises(ProtocolError, match="cache_cut_short must be 0 or 1"):
        decode_message(bad.pack())


def test_speculation_all_rows_and_scatter_helper():
    msg = _speculation(rows=(1, 2, 0))
    dense = decode_message(msg.pack()).dense_probs(vocab_size=11)
    assert np.array_equal(dense[[1, 2, 0]], msg.probs)
    with pytest.raises(ProtocolError, match="vocabulary 11"):
        msg.dense_probs(vocab_size=12)
    probs = np.arange(2 * 1 * 3, dtype=np.float32).reshape(2, 1, 3)
    out = scatter_prob_rows(np.array([3, 1]), probs, batch_size=4)
    assert out.tolist() == [[[0, 0, 0]], [[3, 4, 5]], [[0, 0, 0]], [[0, 1, 2]]]


def test_dense_probs_into_a_reused_buffer():
    msg = _speculation(rows=(2, 0))
    out = np.full((3, 4, 11), 7.0, dtype=np.float32)  # stale contents from an earlier round
    assert msg.dense_probs(out=out) is out
    assert np.array_equal(out[2], msg.probs[0]) and np.array_equal(out[0], msg.probs[1])
    assert not out[1].any()
    empty = _speculation(rows=())
    assert empty.dense_probs(out=out) is out and not out.any()  # the vocabulary comes from `out`
    with pytest.raises(ProtocolError, match="C-contiguous float32 array of shape \\(3, 4, 11\\)"):
        msg.dense_probs(out=np.zeros((3, 4, 12), dtype=np.float32))
    with pytest.raises(ProtocolError, match="float32"):
        msg.dense_probs(out=np.zeros((3, 4, 11), dtype=np.float64))


def test_empty_batches_round_trip():
    prefill = decode_message(PrefillMsg.from_lists([], [], [], [], [], [], []).pack())
    assert prefill.batch_size == 0 and prefill.token_lists() == []
    spec = decode_message(SpeculateMsg.from_lists(1, [], [], [], []).pack())
    assert spec.batch_size == 0 and spec.new_token_lists() == [] and spec.round_id == 1
    answer = decode_message(_speculation(B=0, rows=()).pack())
    assert answer.draft_tokens.shape == (0, 4) and answer.dense_probs(vocab_size=11).shape == (0, 4, 11)
    release = decode_message(ReleaseMsg(seq_ids=[]).pack())
    assert isinstance(release, ReleaseMsg) and release.seq_ids.shape == (0,)
    assert release.seq_ids.dtype == np.int64


def test_small_messages_round_trip():
    assert decode_message(ReleaseMsg(seq_ids=[4, 2**62]).pack()).seq_ids.tolist() == [4, 2**62]
    assert isinstance(decode_message(ShutdownMsg().pack()), ShutdownMsg)
    info = {"vocab_size": 151936, "device": "cpu", "ok": True, "x": None}
    ready = decode_message(ReadyMsg(info=info).pack())
    assert isinstance(ready, ReadyMsg) and ready.info == info
    assert decode_message(ReadyMsg().pack()).info == {}
    hello = decode_message(HelloMsg('{"seed": 3, "name": "ünï"}').pack())
    assert isinstance(hello, HelloMsg) and hello.settings == '{"seed": 3, "name": "ünï"}'
    error = decode_message(ErrorMsg("draft worker failed: ünïcode ✓", traceback="Traceback...").pack())
    assert isinstance(error, ErrorMsg)
    assert error.message == "draft worker failed: ünïcode ✓" and error.traceback == "Traceback..."


def test_every_command_has_a_message_type():
    samples = [
        _prefill(), SpeculateMsg.from_lists(0, [1], [[2]], [0], [1]), _speculation(), ReleaseMsg([1]),
        ShutdownMsg(), HelloMsg('{"a": 1}'), ReadyMsg(), ErrorMsg("x"),
    ]
    commands = [decode_frame(m.pack()).command for m in samples]
    assert sorted(commands) == sorted(Command)


def test_unpack_checks_the_command():
    with pytest.raises(ProtocolError, match="expected a SPECULATION message, got SHUTDOWN"):
        SpeculationMsg.unpack(ShutdownMsg().pack())


def test_decoded_arrays_are_aligned_views_and_typed_messages_own_small_arrays():
    data = _speculation().pack()
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    frame = decode_frame(data)
    for name, arr in frame.arrays.items():
        if arr.size:
            assert (arr.ctypes.data - base) % 8 == 0, name  # aligned, zero-copy view
            assert not arr.flags.writeable, name  # a view into immutable bytes
    out = decode_message(data)
    # small arrays are copied so callers can modify them and hand them to torch.from_numpy ...
    for name in ("draft_tokens", "hit", "fallback", "prob_rows"):
        assert getattr(out, name).flags.writeable, name
    # ... the probabilities stay a view (dense_probs() makes the writable [B, K, V])
    assert not out.probs.flags.writeable
    assert out.probs.ctypes.data == frame.arrays["probs"].ctypes.data
    assert decode_message(bytearray(data)).probs.flags.writeable
    assert np.array_equal(decode_message(memoryview(data)).probs, out.probs)


def test_generic_frame_dtypes_shapes_and_non_contiguous_input():
    rng = np.random.default_rng(3)
    arrays = {
        "f16": rng.random((2, 3)).astype(np.float16),
        "f64": rng.random(5),
        "u16": np.array([1, 65535], dtype=np.uint16),
        "i8": np.array([-128, 127], dtype=np.int8),
        "b": np.array([[True], [False]]),
        "scalar": np.array(2.5, dtype=np.float32),
        "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
        "empty": np.zeros((0, 7), dtype=np.int64),
    }
    fields = {"i": -3, "f": 0.1, "s": "a", "n": None, "t": True, "big": 2**70}
    frame = decode_frame(encode_frame(Command.READY, fields, arrays))
    assert frame.command == Command.READY and frame.fields == fields
    assert list(frame.arrays) == list(arrays)
    for name, arr in arrays.items():
        got = frame.arrays[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr), name
    with pytest.raises(ProtocolError, match="bool, integer or float"):
        encode_frame(Command.READY, arrays={"o": np.array([object()])})
    with pytest.raises(ProtocolError, match="field 'x'"):
        encode_frame(Command.READY, fields={"x": [1, 2]})


# ------------------------------------------------------------------------------------------------
# decode errors


def test_every_truncation_is_detected():
    data = SpeculateMsg.from_lists(3, [1, 2], [[5], [6, 7]], [0, 1], [2, 2]).pack()
    for cut in range(len(data)):
        with pytest.raises(ProtocolError, match="truncated"):
            decode_message(data[:cut])


def test_trailing_bytes_bad_magic_version_and_unknown_command():
    data = ErrorMsg("x").pack()
    with pytest.raises(ProtocolError, match="trailing bytes"):
        decode_message(data + b"\0")
    with pytest.raises(ProtocolError, match="not an SSD protocol message"):
        decode_message(b"XXXX" + data[4:])
    magic, version, command, header_len = struct.unpack_from("<4sHHI", data)
    bumped = struct.pack("<4sHHI", magic, PROTOCOL_VERSION + 1, command, header_len) + data[12:]
    with pytest.raises(ProtocolError, match="version"):
        decode_message(bumped)
    unknown = struct.pack("<4sHHI", magic, version, 999, header_len) + data[12:]
    with pytest.raises(ProtocolError, match="unknown command 999"):
        decode_message(unknown)
    assert issubclass(ProtocolError, ValueError)


def _raw(command: Command, header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("<4sHHI", b"SSDw", PROTOCOL_VERSION, int(command), len(header)) + header + payload


def test_corrupt_headers():
    with pytest.raises(ProtocolError, match="corrupt SHUTDOWN header"):
        decode_message(_raw(Command.SHUTDOWN, b"{not json"))
    with pytest.raises(ProtocolError, match="corrupt SHUTDOWN header"):
        decode_message(_raw(Command.SHUTDOWN, json.dumps({"f": {}}).encode()))
    with pytest.raises(ProtocolError, match="bad array spec"):
        decode_message(_raw(Command.RELEASE, json.dumps({"f": {}, "a": [["x", "O", [1]]]}).encode()))
    with pytest.raises(ProtocolError, match="bad array spec"):
        decode_message(_raw(Command.RELEASE, json.dumps({"f": {}, "a": [["x", "<i8", [-1]]]}).encode()))
    with pytest.raises(ProtocolError, match="bad array spec"):
        decode_message(_raw(Command.RELEASE, json.dumps({"f": {}, "a": [["x", "<i8"]]}).encode()))


def test_well_formed_frames_with_wrong_contents_are_rejected():
    # missing array
    with pytest.raises(ProtocolError, match="malformed RELEASE"):
        decode_message(encode_frame(Command.RELEASE))
    # extra array / unknown field
    with pytest.raises(ProtocolError, match="malformed RELEASE"):
        decode_message(encode_frame(Command.RELEASE, arrays={"seq_ids": np.zeros(1), "x": np.zeros(1)}))
    with pytest.raises(ProtocolError, match="malformed ERROR"):
        decode_message(encode_frame(Command.ERROR, fields={"message": "x", "traceback": "", "other": 2}))
    # missing required scalar
    arrays = {name: getattr(_speculation(), name) for name in SpeculationMsg.ARRAYS}
    with pytest.raises(ProtocolError, match="malformed SPECULATION"):
        decode_message(encode_frame(Command.SPECULATION, {}, arrays))
    # inconsistent ragged lengths
    spec = SpeculateMsg.from_lists(3, [1, 2], [[5], [6, 7]], [0, 1], [2, 2])
    arrays = {name: getattr(spec, name) for name in SpeculateMsg.ARRAYS} | {"new_lengths": np.array([1, 1])}
    with pytest.raises(ProtocolError, match="sums to 2 but SpeculateMsg.new_token_ids has 3"):
        decode_message(encode_frame(Command.SPECULATE, {"round_id": 3}, arrays))
    # a float array where token ids are expected
    arrays = {name: getattr(spec, name) for name in SpeculateMsg.ARRAYS}
    arrays["new_token_ids"] = arrays["new_token_ids"].astype(np.float32)
    with pytest.raises(ProtocolError, match="new_token_ids must be int64"):
        decode_message(encode_frame(Command.SPECULATE, {"round_id": 3}, arrays))
    # wrong scalar type
    with pytest.raises(ProtocolError, match="round_id must be an integer"):
        decode_message(encode_frame(Command.SPECULATE, {"round_id": "3"}, {
            name: getattr(spec, name) for name in SpeculateMsg.ARRAYS
        }))


_NO_PROBS = np.zeros((0, 2, 4), dtype=np.float32)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ReleaseMsg(seq_ids=[[1, 2]]), "must be 1-D"),
        (lambda: ReleaseMsg(seq_ids=[1.5]), "must be int64"),
        (lambda: SpeculateMsg.from_lists(0, [1, 2], [[1]], [0], [1]), "rows, expected 2"),
        (lambda: SpeculateMsg.from_lists(0, [1], [[1]], [-2], [1]), "num_accepted must be >= -1"),
        (lambda: SpeculateMsg.from_lists(0, [1], [[1]], [0], [-1]), "num_drafts must be >= 0"),
        (lambda: SpeculateMsg.from_lists(0, [1], [[1]], [0], [3], [2]), "tree_depth must be >= num_drafts"),
        (lambda: SpeculateMsg(0, [1], [1], [1], [0], np.array([2**40]), [1]), "outside the int32 range"),
        (lambda: SpeculateMsg(True, [1], [1], [1], [0], [1], [1]), "round_id must be an integer"),
        (lambda: PrefillMsg(*([[1]] * 2), [-1], *([[0]] * 7), [0], [], [0]), "lengths must be >= 0"),
        (lambda: PrefillMsg(*([[1]] * 2), [1], *([[0]] * 6), [-1], [0], [], [0]), "first_round_drafts must be >= 0"),
        (lambda: PrefillMsg(*([[1]] * 2), [1], *([[0]] * 6), [0], [2], [], [0]), "num_prompt_tokens must be in"),
        (lambda: PrefillMsg(*([[1]] * 2), [1], *([[0]] * 6), [0], [1], [1, 2], [1]), "constraint_lengths sums to 1"),
        (lambda: SpeculationMsg(0, np.zeros((2, 3)), [0, 0], [0, 0], [], np.zeros((0, 3, 4))), "int64"),
        (lambda: SpeculationMsg(0, np.zeros(2, np.int64), [0, 0], [0, 0], [], np.zeros((0, 3, 4))), "2-D"),
        (lambda: _speculation(rows=(0, 0)), "distinct row indices"),
        (lambda: _speculation(rows=(3,)), "distinct row indices"),
        (lambda: _speculation(rows=(-1,)), "distinct row indices"),
        (lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [True], [1], [], _NO_PROBS), "no fallback, code 0"),
        (lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [False], [3], [], _NO_PROBS), "FALLBACK_CODES"),
        (lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [2], [1], [], _NO_PROBS), "other than 0/1"),
        (lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [0], [1], [], []), "probs must be 3-D"),
        (
            lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [0], [1], [0], np.zeros((1, 3, 4))),
            "3 draft positions, expected K=2",
        ),
        (
            lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [0], [1], [0], np.zeros((2, 2, 4))),
            "probs has 2 rows but prob_rows lists 1",
        ),
        (lambda: SpeculationMsg(0, np.zeros((1, 2), np.int64), [0], [1], [], _NO_PROBS, serve_s="x"),
         "serve_s"),
        (lambda: SpeculateMsg(0, [1], [1], [1], [0], [1], [1], fallback=None), "fallback must be one of"),
        (lambda: SpeculateMsg(0, [1], [1], [1], [0], [1], [1], fallback="auto"), "fallback must be one of"),
        (lambda: ErrorMsg(message=3), "must be strings"),
        (lambda: ReadyMsg(info={"a": [1]}), "field 'a'"),
    ],
)
def test_construction_errors(build, match):
    with pytest.raises(ProtocolError, match=match):
        build()


# ------------------------------------------------------------------------------------------------
# through a real multiprocessing Pipe (one process; a thread sends what exceeds the OS pipe buffer)


def test_round_trip_through_a_pipe():
    client, worker = multiprocessing.Pipe(duplex=True)
    try:
        send_message(client, _prefill())
        got = recv_message(worker)
        assert isinstance(got, PrefillMsg) and [t.tolist() for t in got.token_lists()][2] == [2**40, 7]
        send_message(worker, ReadyMsg(info={"n": 3}))
        assert recv_message(client).info == {"n": 3}
        send_message(client, SpeculateMsg.from_lists(9, [3], [[4, 5]], [1], [4]))
        got = recv_message(worker)
        assert isinstance(got, SpeculateMsg) and got.round_id == 9 and got.new_token_ids.tolist() == [4, 5]

        big = _speculation(B=4, K=4, V=49152, rows=(0, 1, 3), seed=5)  # ~2.4 MB of probabilities
        sender = threading.Thread(target=send_message, args=(worker, big))
        sender.start()
        got = recv_message(client)
        sender.join(timeout=30)
        assert not sender.is_alive()
        assert isinstance(got, SpeculationMsg)
        _assert_arrays_equal(big, got, SpeculationMsg.ARRAYS)
        dense = got.dense_probs()
        assert dense.shape == (4, 4, 49152) and not dense[2].any()

        # recv_bytes_into a caller-owned bytearray gives writable arrays without another copy
        send_message(client, ReleaseMsg([3]))
        buffer = bytearray(1024)
        n = worker.recv_bytes_into(buffer)
        got = decode_message(memoryview(buffer)[:n])
        assert isinstance(got, ReleaseMsg) and got.seq_ids.tolist() == [3] and got.seq_ids.flags.writeable

        send_message(client, ShutdownMsg())
        assert isinstance(recv_message(worker), ShutdownMsg)
    finally:
        client.close()
        worker.close()
