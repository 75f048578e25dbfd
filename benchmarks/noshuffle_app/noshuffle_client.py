"""NO-SHUFFLE BASELINE ClientApp — NOT PRIVATE AGAINST THE SERVER. Benchmark use only.

Used by ``benchmarks/bench_round_overhead.py`` to measure what the shuffler costs per round. It does the SAME
client work as the product's ClientApp (``clients/app.py``): parse and validate the request, refuse a request
whose eps0 / clip-l1 differ from the pinned ones, load this node's partition, compute the report (average
gradient or local delta, ``shuffledp.clients.core.compute_update``), clip to L1 C, randomize with the exact discrete
Laplace randomizer of ``clients/`` and encode it (``shuffledp.clients.core.make_payload``), and keep the same per-round
retry cache. It then replies with the PLAIN encoded report in ``content["report"]`` (uint8 array ``"ct"``):
no HPKE, no signature, no shuffler. The server therefore learns which node sent which noisy report (local DP
only, no amplification): this is not the product and must never be used as a private system.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from shuffledp.clients.app import train_shuffled
from shuffledp.clients.core import make_payload
from shuffledp.clients.messages import (
    ARRAYS_KEY,
    CONFIG_KEY,
    ENVELOPE_ARRAY,
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    RequestError,
    TrainConfig,
    arrays_digest,
    envelope_from_record,
    envelope_record,
)
from shuffledp.clients.settings import PinnedSettings, data_settings_from_configs

__all__ = ["app", "REPORT_KEY", "MESSAGE_TYPE"]

MESSAGE_TYPE = "train.plain"
REPORT_KEY = "report"  # reply content: ArrayRecord {"ct": uint8} holding the plain encoded report
_STATE_REPORT = "noshuffle.last-report"
_STATE_REQUEST = "noshuffle.last-request"
_UNUSED_KEY = bytes(32)  # PinnedSettings wants key bytes; make_payload never uses them (nothing is sealed)

app = ClientApp()
# The paired benchmark (paired-benchmark = true) runs the product's rounds in the same launch: these nodes then
# also answer ``train.shuffled`` with the product's own handler (clients/app.py), unchanged.
app.train("shuffled")(train_shuffled)


def _error(msg: Message, code: int, reason: str) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=msg)


def _reply(msg: Message, report: bytes) -> Message:
    return Message(RecordDict({REPORT_KEY: envelope_record(report)}), reply_to=msg)


_DUMMY_KEYS: list[bytes] = []


def _dummy_seal(report: bytes, round_id: int, digest: bytes) -> None:
    """The CPU cost of sealing (two HPKE layers and a signature) with throw-away keys; nothing is sent."""
    from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

    from shuffledp.shuffler.envelope import seal

    if not _DUMMY_KEYS:
        _DUMMY_KEYS.extend([x25519.X25519PrivateKey.generate().public_key().public_bytes_raw(),
                            x25519.X25519PrivateKey.generate().public_key().public_bytes_raw(),
                            ed25519.Ed25519PrivateKey.generate().private_bytes_raw()])
    seal(report, server_public_key=_DUMMY_KEYS[0], shuffler_public_key=_DUMMY_KEYS[1], signing_key=_DUMMY_KEYS[2],
         key_epoch=0, round_id=round_id, model_digest=digest)


@app.train("plain")
def train_plain(msg: Message, context: Context) -> Message:
    """NOT PRIVATE AGAINST THE SERVER: one ``train.plain`` request -> the plain noisy encoded report."""
    try:
        if ARRAYS_KEY not in msg.content.array_records or CONFIG_KEY not in msg.content.config_records:
            raise RequestError(f"request must carry content[{ARRAYS_KEY!r}] and content[{CONFIG_KEY!r}]")
        cfg = TrainConfig.from_mapping(dict(msg.content.config_records[CONFIG_KEY]))
        if msg.metadata.group_id != str(cfg.round):
            raise RequestError("group_id != str(round)")
        arrays = [np.asarray(a) for a in msg.content.array_records[ARRAYS_KEY].to_numpy_ndarrays()]
        if not arrays:
            raise RequestError("the request carries no model arrays")
        digest = arrays_digest(arrays)  # the product also keys its retry cache on the model digest
    except (RequestError, TypeError, ValueError) as exc:
        return _error(msg, ERR_BAD_REQUEST, f"bad request: {exc}")

    rc, nc = context.run_config, context.node_config
    try:
        pinned = PinnedSettings(
            eps0=float(rc["eps0"]), clip_l1=float(rc["clip-l1"]), client_key=_UNUSED_KEY,
            server_public_key=_UNUSED_KEY, shuffler_public_key=_UNUSED_KEY,
            partition_id=int(nc["partition-id"]), num_partitions=int(nc["num-partitions"]),
            log2_grid=rc.get("log2-grid"),  # type: ignore[arg-type] - PinnedSettings checks it
        )
    except (KeyError, ValueError, TypeError) as exc:
        return _error(msg, ERR_CLIENT_SETUP, f"client setup: {exc}")
    if cfg.eps0 != pinned.eps0 or cfg.clip_l1 != pinned.clip_l1:
        return _error(msg, ERR_PINNED_MISMATCH, "refused: eps0 / clip-l1 differ from the pinned values")

    key: dict[str, Any] = {"round": cfg.round, "model-digest": digest,
                           "config": ";".join(f"{k}={v!r}" for k, v in sorted(cfg.to_dict().items()))}
    if _STATE_REQUEST in context.state.config_records and _STATE_REPORT in context.state.array_records:
        last = dict(context.state.config_records[_STATE_REQUEST])
        if last == key:
            return _reply(msg, envelope_from_record(context.state.array_records[_STATE_REPORT]))
        if int(last["round"]) >= cfg.round:
            return _error(msg, ERR_BAD_REQUEST, f"round {cfg.round} already answered or stale")

    try:
        from shuffledp.clients.data import load_partition

        data = load_partition(pinned.partition_id, pinned.num_partitions, **data_settings_from_configs(nc, rc))
        report = make_payload(arrays, cfg, pinned, data)
    except (RequestError, ValueError, OSError) as exc:
        return _error(msg, ERR_BAD_REQUEST, f"cannot compute a report: {exc}")

    if rc.get("paired-plain-seal"):  # experiment: the plain client also pays for a seal (result discarded)
        _dummy_seal(report, cfg.round, digest)

    context.state[_STATE_REQUEST] = ConfigRecord(key)
    context.state[_STATE_REPORT] = ArrayRecord({ENVELOPE_ARRAY: envelope_record(report)[ENVELOPE_ARRAY]})
    return _reply(msg, report)
