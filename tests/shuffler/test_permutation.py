"""The permutation and what leaves the shuffler.

1. Uniformity. Batches of 8 reports go through the real batch logic (``shuffledp.shuffler.core``, no gRPC, for speed).
   For each batch the output position of the report that arrived j-th is found (by matching inner
   ciphertexts), giving an 8x8 table of counts over all batches. Under a uniform permutation every cell has
   expectation N/8.

   Statistic. The table is a sum of N independent random permutation matrices, not N*8 independent draws:
   every row and every column of each batch sums to 1. For one uniform n x n permutation matrix, Var(P_ij) =
   (n-1)/n^2, Cov within a row or column = -1/n^2, Cov otherwise = 1/(n^2 (n-1)), so the normalised cells
   (X_ij - N/n) / sqrt(N/n) have covariance n/(n-1) * (Q kron Q) with Q = I - J/n, a projection of rank
   (n-1)^2. Hence Pearson's X^2 = sum (X_ij - N/n)^2 / (N/n) is asymptotically n/(n-1) * chi2((n-1)^2), and
   the test uses (n-1)/n * X^2 against chi2 with (n-1)^2 = 49 degrees of freedom. (Without the factor, the
   false-failure rate at a nominal 1e-3 would be about 1e-2.) ``test_statistic_is_calibrated_and_has_power``
   checks this on simulated permutations.

   Significance: ALPHA = 1e-3 per table. Two tables are tested (all accepted; with drops), so when the
   shuffle is uniform this file fails spuriously with probability at most 2e-3 (union bound).

   To keep this fast, fsync is stubbed out here (durability is the crash tests' subject) and the same sealed
   round is fed to several independent cores (each with its own journal): the permutation is drawn per batch
   from the core's CSPRNG and must not depend on the content, so reused content is no loss; a content-derived
   order would in fact show up as a failure here.

2. A static AST scan that no module of the shuffler package uses ``random`` or ``numpy.random``.
3. What the server receives, on the wire: the Fetch stream, the Submit response, the attestation statement;
   and what the logs say: no client identity, key, report id, envelope bytes or peer address, and log lines
   that do not depend on the permutation.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shuffledp import shuffler
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.attestation import DROP_REASONS
from shuffledp.shuffler.core import ShufflerCore
from shuffledp.shuffler.envelope import open_outer

from ._fixtures_adv import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    FETCH,
    SUBMIT,
    envelope_enc,
    envelope_msg,
    header_msg,
    open_all,
    process,
    proto_fields,
    raw_channel,
    write_service_config,
)

ALPHA = 1e-3  # significance per chi-square test (false-failure probability of one test under uniformity)
N_SLOTS = 8  # reports per batch
N_BATCHES = 1600  # batches for the all-accepted table (expected count per cell 200)
N_BATCHES_DROPS = 400  # batches for the table with drops (6 accepted, expected count per cell ~67)
N_CORES = 20  # independent cores (journals) that each seal the same rounds


def perm_chi2(table: np.ndarray) -> tuple[float, float]:
    """Scaled Pearson statistic of an n x n table of summed permutation matrices, and its p-value."""
    n = table.shape[0]
    if table.shape != (n, n):
        raise ValueError("table must be square")
    batches = table.sum() / n
    if not (np.allclose(table.sum(axis=0), batches) and np.allclose(table.sum(axis=1), batches)):
        raise ValueError("not a sum of permutation matrices: row/column sums differ")
    expected = batches / n
    x2 = float(((table - expected) ** 2 / expected).sum())
    scaled = x2 * (n - 1) / n
    return scaled, float(stats.chi2.sf(scaled, (n - 1) ** 2))


def _table_from_positions(positions: Any, n: int) -> np.ndarray:
    """Row j, column p: how many batches put the j-th input at output position p."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1, n)
    t = np.zeros((n, n))
    np.add.at(t, (np.broadcast_to(np.arange(n), pos.shape), pos), 1)
    return t


def test_statistic_is_calibrated_and_has_power() -> None:
    """The scaled statistic is chi2(49) for uniform permutations and rejects a classic biased shuffle.

    numpy here only simulates permutations to check the statistic; nothing privacy-relevant is generated.
    """
    rng = np.random.default_rng(20261121)
    n = N_SLOTS
    sims = np.array([
        perm_chi2(_table_from_positions(np.argsort(rng.random((N_BATCHES, n)), axis=1), n))[0]
        for _ in range(200)
    ])
    # mean of 200 chi2(49) draws: 49 +- sqrt(98/200) = 0.7 (5 sd margin); unscaled it would average 56
    assert abs(sims.mean() - 49) < 3.5
    assert abs(sims.mean() * n / (n - 1) - 56) < 4
    # power: the naive "swap i with any j" shuffle (n^n paths onto n! permutations) is not uniform
    naive = []
    for _ in range(N_BATCHES):
        a = list(range(n))
        for i in range(n):
            j = int(rng.integers(0, n))
            a[i], a[j] = a[j], a[i]
        pos = [0] * n
        for p, x in enumerate(a):
            pos[x] = p
        naive.append(pos)
    assert perm_chi2(_table_from_positions(naive, n))[1] < ALPHA
    # and the identity (arrival order released as is) is rejected with certainty
    assert perm_chi2(_table_from_positions([list(range(n))] * N_BATCHES, n))[1] < 1e-100


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    monkeypatch.setattr(os, "fdatasync", lambda fd: None)


def _cores(kit: Any, tmp_path: Path, n: int) -> list[ShufflerCore]:
    return [ShufflerCore(kit.core_config(tmp_path / f"j{c}")) for c in range(n)]


def _positions_over_rounds(kit: Any, tmp_path: Path, n_batches: int,
                           batch: Callable[[int], tuple[list[bytes], list[bytes]]]) -> list[list[int]]:
    """``n_batches`` batches spread over N_CORES independent cores: round r's (envelopes, honest inners) come
    from ``batch(r)`` and every core shuffles them; the output positions of the honest inners, per batch."""
    cores = _cores(kit, tmp_path, N_CORES)
    positions: list[list[int]] = []
    try:
        for r in range(1, n_batches // N_CORES + 1):
            envs, inners = batch(r)
            for core in cores:
                positions.append(_positions(core, kit, r, envs, inners))
    finally:
        for core in cores:
            core.close()
    return positions


def _positions(core: ShufflerCore, kit: Any, round_id: int, envs: list[bytes], inners: list[bytes]) -> list[int]:
    """Seal one batch; return, for the j-th accepted input, its output position."""
    b = core.begin(kit.header(len(envs), round_id=round_id))
    for e in envs:
        b.add(e)
    sealed = b.finish()
    out = list(core.read_batch(sealed.batch_id))
    index = {x: p for p, x in enumerate(out)}
    assert len(index) == len(inners) == len(out)
    return [index[x] for x in inners]


def _inner_of(kit: Any, envelope: bytes, round_id: int) -> bytes:
    return bytes(
        open_outer(envelope, shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=round_id,
                   model_digest=kit.digest).inner
    )


def test_output_position_is_uniform(kit, tmp_path: Path, no_fsync: None) -> None:
    def batch(r: int) -> tuple[list[bytes], list[bytes]]:
        envs = [kit.seal(i, round_id=r) for i in range(N_SLOTS)]
        return envs, [_inner_of(kit, e, r) for e in envs]

    positions = _positions_over_rounds(kit, tmp_path, N_BATCHES, batch)
    table = _table_from_positions(positions, N_SLOTS)
    stat, p = perm_chi2(table)
    assert len(positions) == N_BATCHES
    assert p > ALPHA, f"output positions are not uniform: scaled X^2 = {stat:.1f} on 49 df, p = {p:.2e}\n{table}"


def test_output_position_is_uniform_with_drops(kit, tmp_path: Path, no_fsync: None) -> None:
    """Dropped envelopes leave holes that are squeezed out; the accepted ones must still be uniformly placed."""
    def batch(r: int) -> tuple[list[bytes], list[bytes]]:
        good = [kit.seal(i, round_id=r) for i in range(6)]
        envs = good[:2] + [b"garbage"] + good[2:5] + [good[5][:-1]] + good[5:]  # arrivals 2 and 6 dropped
        return envs, [_inner_of(kit, e, r) for e in good]

    positions = _positions_over_rounds(kit, tmp_path, N_BATCHES_DROPS, batch)
    table = _table_from_positions(positions, 6)
    stat, p = perm_chi2(table)
    assert p > ALPHA, f"positions with drops are not uniform: scaled X^2 = {stat:.1f} on 25 df, p = {p:.2e}\n{table}"


# --------------------------------------------------------------------------------------------- static scan
PKG = Path(shuffler.__file__).resolve().parent
_NUMPY = {"numpy"}


def banned_rng_uses(source: str) -> list[str]:
    """Uses of the ``random`` module or of ``numpy.random`` in Python source (by AST, not by text)."""
    found: list[str] = []
    numpy_names: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "random" or a.name.startswith("random.") or a.name.startswith("numpy.random"):
                    found.append(f"import {a.name}")
                if a.name == "numpy" or a.name.startswith("numpy."):
                    numpy_names.add(a.asname or "numpy")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod == "random" or mod.startswith("random.") or mod.startswith("numpy.random"):
                found.append(f"from {mod} import ...")
            if mod == "numpy" and any(a.name == "random" for a in node.names):
                found.append("from numpy import random")
        elif isinstance(node, ast.Call):
            # __import__("random"), importlib.import_module("numpy.random")
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant):
                target = str(node.args[0].value)
                if target == "random" or target.startswith("random.") or target.startswith("numpy.random"):
                    found.append(f"{name}({target!r})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "random" and isinstance(node.value, ast.Name):
            if node.value.id in numpy_names | _NUMPY | {"np"}:
                found.append(f"{node.value.id}.random")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import random",
        "import random as r",
        "from random import shuffle",
        "import numpy as np\nnp.random.shuffle([1])",
        "import numpy as xx\nxx.random.default_rng()",
        "import numpy.random",
        "from numpy.random import default_rng",
        "from numpy import random",
        "__import__('random')",
        "import importlib\nimportlib.import_module('numpy.random')",
    ],
)
def test_scanner_catches_banned_rng(snippet: str) -> None:
    assert banned_rng_uses(snippet)


def test_scanner_accepts_csprng() -> None:
    assert banned_rng_uses("import secrets\nsecrets.SystemRandom().shuffle([1, 2])\nimport os\nos.urandom(8)") == []


def test_no_random_or_numpy_random_in_the_shuffler_package() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert {"core.py", "envelope.py", "service.py", "journal.py"} <= {p.name for p in files}
    offenders = {str(p.relative_to(PKG)): banned_rng_uses(p.read_text()) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


# ----------------------------------------------------------------------------------- the wire and the logs
@pytest.fixture(scope="module")
def live(kit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = tmp_path_factory.mktemp("wire")
    p = process(kit, write_service_config(kit, d / "shuffler.toml"))
    p.start()
    try:
        yield p
    finally:
        p.stop()


def _secrets_of(kit: Any, envs: list[bytes], round_id: int) -> dict[str, bytes]:
    """Byte strings that would link an output to a client or an input if they left the shuffler."""
    out: dict[str, bytes] = {}
    for j, e in enumerate(envs):
        rep = open_outer(e, shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=round_id,
                         model_digest=kit.digest)
        out[f"signer{j}"] = rep.signer_public_key
        out[f"report_id{j}"] = rep.report_id
        out[f"enc{j}"] = envelope_enc(e)
        out[f"envelope_head{j}"] = e[:48]
    return out


def test_fetch_stream_carries_only_inner_ciphertexts(kit, live) -> None:
    r = 1
    envs = [kit.seal(i, round_id=r) for i in range(6)]
    with kit.client(live.address) as c:
        att = c.submit(round_id=r, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs)
    with raw_channel(kit, live.address) as ch:
        call = ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(
            pb.FetchRequest(batch_id=att.batch_id).SerializeToString(), timeout=20
        )
        raw = list(call)
        initial, trailing = call.initial_metadata(), call.trailing_metadata()
    inners = []
    for msg in raw:
        fields = proto_fields(msg)
        # only field 1 (inner), length-delimited, each of the attested length; no position, time, peer, signer
        # or batch id rides along (small inners are packed several per message)
        assert fields and all((f, wt) == (1, 2) for f, wt, _ in fields)
        assert all(len(v) == att.inner_length for _, _, v in fields)
        inners.extend(v for _, _, v in fields)
    assert len(inners) == att.n_accepted == 6
    assert Counter(open_all(kit, inners, r)) == Counter(kit.payload(i) for i in range(6))
    # no application metadata on the stream either
    assert [k for k, _ in (initial or ())] == [] and [k for k, _ in (trailing or ())] == []
    blob = b"".join(raw)
    for name, value in _secrets_of(kit, envs, r).items():
        assert value not in blob, name
    for cid, pk in kit.enrolment.items():
        assert pk not in blob and cid.encode() not in blob


def test_submit_response_and_attestation_carry_aggregates_only(kit, live) -> None:
    r = 2
    envs = [kit.seal(i, round_id=r) for i in range(5)] + [b"garbage"]
    msgs = [header_msg(kit, len(envs), round_id=r)] + [envelope_msg(e) for e in envs]
    with raw_channel(kit, live.address) as ch:
        resp, call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None).with_call(
            iter(msgs), timeout=20
        )
        assert [k for k, _ in (call.trailing_metadata() or ())] == []
    assert sorted(f for f, _, _ in proto_fields(resp)) == [1, 2, 3]  # batch_id, statement, signature
    parsed = pb.SubmitResponse.FromString(resp)
    doc = json.loads(parsed.statement)
    required = {
        "format", "batch_id", "protocol_version", "key_epoch", "round_id", "model_digest", "k", "n_received",
        "n_accepted", "inner_length", "output_digest", "dropped",
    }
    assert required <= set(doc) <= required | {"envelope_length"}  # the latter only when the header set one
    assert set(doc["dropped"]) == set(DROP_REASONS) and all(isinstance(v, int) for v in doc["dropped"].values())
    text = parsed.statement.decode()
    for name, value in _secrets_of(kit, envs[:5], r).items():
        assert value.hex() not in text, name
    for cid, pk in kit.enrolment.items():
        assert cid not in text and pk.hex() not in text


_PEER = re.compile(r"ipv[46]:|127\.0\.0\.1:\d+|\[::1\]:\d+")


def _assert_log_clean(text: str, kit: Any, leaks: dict[str, bytes]) -> None:
    lowered = text.lower()
    for cid, pk in kit.enrolment.items():
        assert cid not in text, cid
        assert pk.hex() not in lowered, f"public key of {cid}"
    for name, value in leaks.items():
        assert value.hex() not in lowered, name
    assert not _PEER.search(text), "a peer address appears in the log"


def test_logs_name_no_client_and_do_not_depend_on_the_permutation(kit, running, caplog) -> None:
    """In-process mTLS server, every logger at DEBUG. Three batches of the same shape (six honest reports, one
    garbage, one duplicate of client 0) get different permutations; their log lines must be identical once the
    round id and batch id are masked, so they cannot encode the permutation, and name nothing secret."""
    caplog.set_level(logging.DEBUG)
    per_batch: list[list[str]] = []
    orders: list[list[bytes]] = []
    leaks: dict[str, bytes] = {}
    for r in (31, 32, 33):
        envs = [kit.seal(i, round_id=r) for i in range(6)]
        leaks.update({f"{k}-r{r}": v for k, v in _secrets_of(kit, envs, r).items()})
        batch = envs[:3] + [b"garbage"] + envs[3:] + [kit.seal(0, round_id=r, payload=kit.payload(77))]
        caplog.clear()
        with kit.client(running.address) as c:
            att = c.submit(round_id=r, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=batch)
            out = c.fetch_all(att)
        # the permutation of this batch: payload order of the output
        orders.append(open_all(kit, out, r))
        leaks[f"batch-r{r}"] = att.batch_id
        lines = []
        for rec in caplog.records:
            msg = rec.getMessage()
            _assert_log_clean(msg, kit, leaks)
            line = f"{rec.name}:{rec.levelname}:{msg}"
            lines.append(line.replace(str(r), "<round>").replace(att.batch_id.hex(), "<id>"))
        per_batch.append(lines)
    assert any("sealed" in line for line in per_batch[0]), per_batch[0]  # the log did see the batch
    assert len({tuple(o) for o in orders}) > 1, "three identical permutations: cannot check independence"
    assert per_batch[0] == per_batch[1] == per_batch[2]


def test_process_log_names_no_client(kit, live) -> None:
    r = 3
    envs = [kit.seal(i, round_id=r) for i in range(5)]
    leaks = _secrets_of(kit, envs, r)
    with kit.client(live.address) as c:
        att = c.submit(round_id=r, key_epoch=kit.key_epoch, model_digest=kit.digest,
                       envelopes=envs + [kit.seal(1, round_id=r, payload=kit.payload(9))])
        c.fetch_all(att)
        with pytest.raises(Exception):
            c.submit(round_id=r + 1, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs[:2])
    text = live.log_tail(10_000)
    assert "sealed" in text
    _assert_log_clean(text, kit, leaks)
