"""Which replies of a round become reports and an update: dropouts, garbage, tagging, streaming to the real shuffler."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, RecordDict

from shuffledp.clients import messages as M
from shuffledp.clients.report import decode_report
from shuffledp.server.optim import flatten
from shuffledp.server.rounds import envelope_of, sample_nodes

from ._rounds_records import _ledger_rounds, _stats  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def test_honest_round_is_applied_charged_and_checkpointed(h: Any) -> None:
    cfg = h.config()
    grid = h.grid([h.honest()] * h.N)
    recording_opener, opened = h.recording_opener(cfg)

    engine = h.engine(cfg, grid, open_inner=recording_opener)
    attested: list[Any] = []
    engine.on_attestation = lambda round_id, att, charged: attested.append((round_id, att, charged))
    assert engine.restore() == 1
    before = [a.copy() for a in engine.arrays]
    t_before = time.time()
    out = engine.run_round(1)
    assert out.status == "applied", out.reason
    assert (out.n_sampled, out.n_replies, out.n_envelopes, out.n_reports, out.n_applied) == (h.N,) * 5
    assert out.n_bad_reports == 0
    assert 0.0 <= out.accuracy <= 1.0 and out.loss > 0
    # the update is one SGD step with the mean of exactly the opened reports
    mean = np.mean([decode_report(p, expected_dim=engine.dim) for p in opened], axis=0)
    expected = flatten(before) - cfg.server_lr * mean
    np.testing.assert_allclose(flatten(engine.arrays), expected, rtol=0, atol=1e-5)
    rows = engine.ledger.rows()
    assert [(r["round"], r["n_reports"], r["eps0"]) for r in rows] == [(1, h.N, cfg.eps0)]
    # the row names the batch it charged, as the shuffler's signed attestation names it (for shuffledp audit)
    [(_, att, charged)] = attested
    assert charged and (rows[0]["key_epoch"], rows[0]["batch_id"]) == (cfg.key_epoch, att.batch_id.hex())
    assert [(e.n, e.eps0) for e in engine.accountant.rounds] == [(h.N, cfg.eps0)]
    ckpt = engine.store.load()
    assert ckpt.round == 1
    np.testing.assert_array_equal(ckpt.arrays[0], engine.arrays[0])
    # the round's end on the ServerApp's own clock is checkpointed (deploy local's round boundaries)
    assert [h["round"] for h in ckpt.history] == [1]
    assert t_before <= ckpt.history[0]["finished_at"] == out.finished_at <= time.time()
    # what left the server: exactly the schema, nothing more
    msg = grid.sent[0]
    assert msg.metadata.message_type == M.MESSAGE_TYPE and msg.metadata.group_id == "1"
    assert set(msg.content.keys()) == {M.ARRAYS_KEY, M.CONFIG_KEY}
    assert dict(msg.content[M.CONFIG_KEY])["eps0"] == cfg.eps0


def test_report_on_a_foreign_grid_is_counted_bad(h: Any) -> None:
    from shuffledp.clients.report import decode_report_full, encode_report

    cfg = h.config()
    opener = h.opener(cfg)

    def rescaling_opener(inner: bytes, round_id: int) -> bytes:
        payload = opener(inner, round_id)
        if not rescaling_opener.done:  # type: ignore[attr-defined] - a flag kept on the function
            rescaling_opener.done = True  # type: ignore[attr-defined] - a flag kept on the function
            rep = decode_report_full(payload, expected_dim=650)
            return encode_report(rep.ints, log2_grid=rep.log2_grid + 5, eps_used=rep.eps_used)
        return payload

    rescaling_opener.done = False  # type: ignore[attr-defined] - a flag kept on the function
    engine = h.engine(cfg, h.grid([h.honest()] * h.N), open_inner=rescaling_opener)
    engine.restore()
    out = engine.run_round(1)
    assert out.status == "applied" and out.n_bad_reports == 1 and out.n_applied == h.N - 1


def test_dropouts_below_k_skip_the_round_and_charge_nothing(h: Any) -> None:
    cfg = h.config()
    grid = h.grid([h.honest()] * (h.K - 1) + [h.silent] * (h.N - h.K + 1))
    engine = h.engine(cfg, grid)
    engine.restore()
    out = engine.run_round(1)
    assert out.status == "skipped"
    assert out.n_envelopes == h.K - 1
    assert "fewer than min-reports k=8" in out.reason
    assert _ledger_rounds(engine) == []
    assert engine.accountant.rounds == ()
    # the submission was cancelled: the shuffler sealed nothing (gRPC may let it see the cancellation as an early
    # end of stream, refused as count_mismatch) and nothing was accepted
    assert _stats(h)["batches_sealed"] == 0 and _stats(h)["reports_accepted"] == 0
    assert engine.store.load().round == 1  # the id is used; a later round gets a new one


def test_garbage_replies_are_counted_and_dropped(h: Any) -> None:
    cfg = h.config()
    behaviours = [h.honest()] * (h.N - 3) + [h.garbage_envelope, h.garbage_record, h.inner_garbage()]
    engine = h.engine(cfg, h.grid(behaviours))
    engine.restore()
    out = engine.run_round(1)
    assert out.status == "applied"
    assert out.n_malformed_replies == 1  # the wrong record shape never leaves the server
    assert out.n_envelopes == h.N - 1  # random bytes and the bad-payload envelope go to the shuffler
    assert out.n_reports == h.N - 2  # the shuffler drops the random bytes (they do not open)
    assert out.n_bad_reports == 1 and out.n_applied == h.N - 3  # the bad payload is opened, counted, skipped
    assert [(r["round"], r["n_reports"]) for r in engine.ledger.rows()] == [(1, h.N - 2)]


def test_a_reply_that_repeats_an_earlier_envelope_is_not_relayed_twice(h: Any) -> None:
    """Two replies carrying the same envelope bytes (a client or a relay replaying one): the ServerApp relays the
    first and sends an empty placeholder for the second (counted with the malformed replies), so the shuffler's
    count still matches the requests and the repeat is never a second report."""
    import secrets as _secrets

    from tests.server.conftest import envelope_reply

    same = _secrets.token_bytes(400)

    def replaying(msg: Any, pid: int) -> Any:
        return envelope_reply(msg, same)

    engine = h.engine(h.config(), h.grid([h.honest()] * (h.N - 2) + [replaying, replaying]))
    engine.restore()
    out = engine.run_round(1)
    assert out.status == "applied", out.reason
    assert out.n_malformed_replies == 1 and out.n_envelopes == h.N - 1
    assert out.n_reports == h.N - 2
    dropped = _stats(h)["dropped"]
    assert dropped["empty"] == 1 and sum(dropped.values()) == 2  # the placeholder, and the random bytes


def _tagging(engine: Any, victim_index: int) -> None:
    """Make the server give one node a slightly different model (a tagging attack on that node)."""
    original = engine._build_messages

    def build(nodes: Any, round_id: int) -> list[Any]:
        msgs = original(nodes, round_id)
        arrays = [a.copy() for a in engine.arrays]
        arrays[0][0, 0] += 1e-3
        victim = msgs[victim_index]  # its own content: the messages of a round share one content object
        victim.content = RecordDict({M.ARRAYS_KEY: ArrayRecord(arrays), M.CONFIG_KEY: victim.content[M.CONFIG_KEY]})
        return msgs

    engine._build_messages = build


def test_tagged_client_is_dropped_and_the_honest_ones_count(h: Any) -> None:
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    _tagging(engine, victim_index=3)
    out = engine.run_round(1)
    assert out.status == "applied"
    assert out.n_envelopes == h.N and out.n_reports == h.N - 1  # the tagged envelope does not open
    assert out.n_applied == h.N - 1
    assert [(r["round"], r["n_reports"]) for r in engine.ledger.rows()] == [(1, h.N - 1)]


def test_tagging_that_leaves_fewer_than_k_skips_the_round(h: Any) -> None:
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.K + [h.silent] * (h.N - h.K)))
    engine.restore()
    _tagging(engine, victim_index=0)
    out = engine.run_round(1)
    assert out.status == "skipped"
    assert "the shuffler refused the batch" in out.reason
    assert _ledger_rounds(engine) == [] and engine.accountant.rounds == ()
    assert _stats(h)["batches_refused"] == 1


def test_a_message_limit_below_the_envelope_length_is_refused_before_any_round(h: Any) -> None:
    from shuffledp.server.config import ConfigError

    grid = h.grid([h.honest()] * h.N)
    with pytest.raises(ConfigError, match="'max-message-bytes' \\(1024\\) is below this model's envelope length"):
        h.engine(h.config(**{"max-message-bytes": 1024}), grid)
    assert grid.sent == []


def test_envelope_of_keeps_bytes_only_and_classifies_the_rest(h: Any) -> None:
    grid = h.grid([h.honest(), h.refusing, h.garbage_record])
    engine = h.engine(h.config(), grid)
    ids = grid.push_messages(engine._build_messages(list(grid.get_node_ids()), 1))
    honest, refusal, garbage = grid.pull_messages(ids)
    envelope, kind = envelope_of(honest, max_bytes=1 << 20)
    assert type(envelope) is bytes and kind == "ok" and len(envelope) == engine.envelope_length
    assert envelope_of(refusal, max_bytes=1 << 20) == (None, "error")
    assert envelope_of(garbage, max_bytes=1 << 20) == (None, "malformed")
    assert envelope_of(honest, max_bytes=16) == (None, "malformed")  # oversized


def test_replies_are_streamed_as_they_arrive_with_placeholders_for_the_rest(h: Any) -> None:
    """Replies trickle in over several polls; a copied envelope, an error reply, garbage and a silent node each
    become an empty placeholder, so the shuffler attests exactly the honest reports."""
    last: dict[str, Any] = {}
    honest = h.honest()

    def remembering(msg: Any, pid: int) -> Any:
        last["reply"] = honest(msg, pid)
        return last["reply"]

    def copycat(msg: Any, pid: int) -> Any:  # replays another node's envelope bytes
        return h.kit_envelope_reply(msg, M.envelope_from_record(last["reply"].content[M.ENVELOPE_KEY]))

    behaviours = [remembering] * (h.N - 4) + [copycat, h.refusing, h.garbage_record, h.silent]
    grid = h.grid(behaviours)
    released: list[int] = []
    pull = grid.pull_messages

    def trickle(ids: Any) -> list[Any]:  # at most 3 replies per poll
        got = pull(list(ids)[:3])
        released.append(len(got))
        return got

    grid.pull_messages = trickle  # type: ignore[method-assign] - the fake grid, patched
    engine = h.engine(h.config(), grid)
    out = engine.run_round(1)
    assert out.status == "applied", out.reason
    assert sum(1 for n in released if n) >= (h.N - 1) // 3  # really spread over many polls
    assert (out.n_replies, out.n_error_replies, out.n_malformed_replies) == (h.N - 1, 1, 2)
    assert out.n_envelopes == h.N - 4 and out.n_reports == h.N - 4
    row = engine.ledger.rows()[-1]
    assert row["n_reports"] == h.N - 4
    stats = _stats(h)
    assert stats["dropped"]["empty"] == 4 and stats["reports_accepted"] == h.N - 4


def test_streamed_envelopes_are_sent_in_whole_packed_messages(h: Any) -> None:
    """The collector flushes once the next envelope would not fit in a packed message (framing included), so a
    flush is never a full message plus one envelope travelling alone."""
    from shuffledp.shuffler.wire import FIELD_OVERHEAD

    grid = h.grid([h.honest()] * h.N)
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: pull(list(ids)[:1])  # type: ignore[method-assign] - the fake grid, patched  # one reply per poll
    engine = h.engine(h.config(), grid)
    sends: list[int] = []
    open_submit = engine.shuffler.open_submit

    def recording_open_submit(**kw: Any) -> Any:
        stream = open_submit(**kw)
        stream.batch_bytes = 3 * (engine.envelope_length + FIELD_OVERHEAD)  # room for exactly three envelopes
        send_many = stream.send_many
        stream.send_many = lambda envs: (sends.append(len(envs)), send_many(envs))[1]
        return stream

    engine.shuffler.open_submit = recording_open_submit
    out = engine.run_round(1)
    assert out.status == "applied", out.reason
    assert sum(sends) == h.N and max(sends) == 3, sends
    assert sends[:-1] == [3] * (len(sends) - 1), sends  # whole messages (the last takes the remainder)


def test_sample_nodes_fraction_and_validation() -> None:
    nodes = list(range(100, 200))
    picked = sample_nodes(nodes, 0.25)
    assert len(picked) == 25 and len(set(picked)) == 25 and set(picked) <= set(nodes)
    assert sample_nodes(nodes, 1.0) == nodes
    assert len(sample_nodes(nodes, 0.001)) == 1
    with pytest.raises(ValueError, match="fraction must be in"):
        sample_nodes(nodes, 0.0)
    with pytest.raises(ValueError, match="no connected nodes"):
        sample_nodes([], 0.5)


def test_wait_for_nodes_waits_for_a_stable_count_and_gives_up_at_the_deadline(monkeypatch) -> None:
    """The node-wait policy shared by the ServerApp and the no-shuffle baseline app, on a fake clock: nodes
    register progressively; the wait returns once min_nodes are there and the count has been stable for
    ``settle`` seconds, or with whatever is connected at ``node_wait``."""
    import shuffledp.server.rounds as rounds_mod

    clock = [0.0]
    monkeypatch.setattr(rounds_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(rounds_mod.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    class Registering:
        def __init__(self, counts: list[int]) -> None:
            self.counts, self.calls = counts, 0

        def get_node_ids(self) -> list[int]:
            n = self.counts[min(self.calls, len(self.counts) - 1)]
            self.calls += 1
            return list(range(n)) + [0]  # duplicates are counted once

    # 2, 5, 8 nodes, then 8 for good: min 4 is reached at 5, but the count changes again; it returns 8 nodes
    # once they have been stable for 1.5 s (polls every 0.5 s)
    grid = Registering([2, 5, 8])
    assert rounds_mod.wait_for_nodes(grid, 4, node_wait=60, settle=1.5) == list(range(8))
    assert clock[0] == pytest.approx(2.5)
    # never enough nodes: it returns what is there at the deadline
    clock[0] = 0.0
    assert rounds_mod.wait_for_nodes(Registering([3]), 4, node_wait=2.0, settle=0.0) == [0, 1, 2]
    assert clock[0] == pytest.approx(2.0)


def test_messages_the_grid_could_not_push_get_no_slot(h: Any) -> None:
    """A SuperLink returns "" for each message it could not store. Those have no slot: the count announced to
    the shuffler is the number of messages pushed, so the batch is sealed (not refused as count_mismatch) and
    the honest reports count."""
    grid = h.grid([h.honest()] * h.N)
    push = grid.push_messages

    def lossy(messages: Any) -> list[str]:
        ids = push(messages)
        for i in (1, 4):  # two messages not stored: no id, and no reply will ever come
            grid.pending.pop(ids[i], None)
            ids[i] = ""
        return ids

    grid.push_messages = lossy  # type: ignore[method-assign] - the fake grid, patched
    engine = h.engine(h.config(), grid)
    out = engine.run_round(1)
    assert out.status == "applied", out.reason
    assert (out.n_not_pushed, out.n_replies, out.n_reports) == (2, h.N - 2, h.N - 2)
    assert _stats(h)["batches_refused"] == 0 and _stats(h)["reports_accepted"] == h.N - 2


def _l2_client(h: Any, name: str, eps0: float, clip_l2: float) -> Any:
    """An honest client pinned to an L2 mechanism: the clients package's make_envelope on its digits partition."""
    from shuffledp.clients.core import make_envelope
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.settings import PinnedSettings

    def behaviour(msg: Any, pid: int) -> Any:
        pinned = PinnedSettings(eps0=eps0, clip_l1=1.0, client_key=h.keys.client_key(pid),
                                server_public_key=h.keys.server_pk, shuffler_public_key=h.keys.shuffler_pk,
                                partition_id=pid, num_partitions=h.N, mechanism=name, clip_l2=clip_l2)
        arrays = msg.content[M.ARRAYS_KEY].to_numpy_ndarrays()
        envelope = make_envelope(arrays, msg.content[M.CONFIG_KEY], pinned, load_partition(pid, h.N))
        return h.kit_envelope_reply(msg, envelope)

    return behaviour


def test_a_duchi_round_is_decoded_with_the_runs_mechanism_and_labelled_in_the_ledger(h: Any) -> None:
    from shuffledp.clients.mechanism import make_mechanism

    cfg = h.config(mechanism="duchi", eps0=2.0, **{"clip-l2": 0.5})
    recording_opener, opened = h.recording_opener(cfg)

    grid = h.grid([_l2_client(h, "duchi", 2.0, 0.5)] * (h.N - 1) + [h.refusing])  # one pinned to another mechanism
    engine = h.engine(cfg, grid, open_inner=recording_opener)
    engine.restore()
    before = flatten(engine.arrays)
    out = engine.run_round(1)
    request = dict(grid.sent[0].content[M.CONFIG_KEY])
    assert (request["mechanism"], request["clip-l2"]) == ("duchi", 0.5)
    # the client pinned to another mechanism refused (pinned mismatch): an error reply, not a report
    assert out.status == "applied", out.reason
    assert (out.n_reports, out.n_applied, out.n_bad_reports, out.n_error_replies) == (h.N - 1, h.N - 1, 0, 1)
    mech = make_mechanism("duchi", eps0=2.0, clip_l2=0.5)
    assert all(len(p) == mech.report_length(engine.dim) == 53 for p in opened)
    mean = np.mean([mech.decode(p, engine.dim) for p in opened], axis=0)
    np.testing.assert_allclose(flatten(engine.arrays), before - cfg.server_lr * mean, rtol=1e-5, atol=1e-4)
    [row] = engine.ledger.rows()
    assert row["mechanism"] == f"duchi-l2(d={engine.dim},C=0.5,eps0=2,report=gradient)"
