"""A real shuffler process for the in-process path (``through_shuffler``): each round's reports are sealed as the
apps seal them, submitted to a shuffler process over mTLS, fetched back in its permuted order and opened.

Setup (once per run): a temporary key directory (:func:`shuffledp.shuffler.keys.init_key_directory`: one enrolled
Ed25519 key per client, the server's and the shuffler's HPKE keys, the mTLS certificates), a
:class:`shuffledp.shuffler.process.ShufflerProcess` and a :class:`shuffledp.shuffler.client.ShufflerClient`, as
:mod:`shuffledp.deploy.audit_privacy_e2e` and ``benchmarks/bench_rounds.py`` start them. Per round: client i's
payload is sealed with :func:`shuffledp.shuffler.envelope.seal` (inner layer to the server key, outer to the
shuffler key, signed with client i's key, bound to the round id, key epoch and the model's digest), the batch is
submitted and its attestation verified, the permuted inner ciphertexts are fetched and opened with
:func:`shuffledp.shuffler.envelope.open_inner` (what :mod:`shuffledp.server.rounds` does before decoding).

This is slow (two HPKE layers, a signature and its check per report, in Python): it checks the path at small n;
studies at scale leave it out (the permutation does not change the mean).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from shuffledp.clients.messages import arrays_digest

__all__ = ["ShufflerExchange"]

_KEY_EPOCH = 0
_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class ShufflerExchange:
    """One shuffler process for a run of ``n_clients`` clients (module docstring); a context manager.

    Args:
        n_clients: the clients enrolled (client i signs report i of every round).
        workdir: where the key directory goes (default: a temporary directory, removed on exit).
        startup_timeout: seconds to wait for the shuffler process.
        timeout: seconds each call to the shuffler may take.
    """

    def __init__(self, n_clients: int, *, workdir: str | Path | None = None, startup_timeout: float = 120.0,
                 timeout: float = 300.0) -> None:
        if isinstance(n_clients, bool) or not isinstance(n_clients, int) or n_clients < 1:
            raise ValueError(f"n_clients must be an int >= 1, got {n_clients!r}")
        self.n_clients = n_clients
        self._workdir = workdir
        self._startup_timeout = startup_timeout
        self._timeout = timeout
        self._stack = contextlib.ExitStack()
        self.batches = 0

    def __enter__(self) -> ShufflerExchange:
        from shuffledp.shuffler import keys as keyfiles
        from shuffledp.shuffler.client import ShufflerClient
        from shuffledp.shuffler.process import ShufflerProcess

        try:
            root = Path(self._workdir) if self._workdir is not None else Path(
                self._stack.enter_context(tempfile.TemporaryDirectory(prefix="sweep-shuffler-")))
            d = keyfiles.init_key_directory(root / "keys", self.n_clients, key_epoch=_KEY_EPOCH)
            self._server_pk = keyfiles.load_public_key(d.server_hpke_pub, "x25519")
            self._shuffler_pk = keyfiles.load_public_key(d.shuffler_hpke_pub, "x25519")
            self._server_sk = keyfiles.load_private_key(d.server_hpke_key, "x25519")
            self._client_keys = [keyfiles.load_private_key(d.client_key(i), "ed25519") for i in range(self.n_clients)]
            ca, cert, key = d.ca_cert.read_bytes(), d.serverapp_cert.read_bytes(), d.serverapp_tls_key.read_bytes()
            proc = self._stack.enter_context(ShufflerProcess(
                d.config, root_certificate=ca, client_certificate=cert, client_key=key,
                startup_timeout=self._startup_timeout))
            self._client = self._stack.enter_context(ShufflerClient(
                proc.address, root_certificate=ca, client_certificate=cert, client_key=key,
                shuffler_verify_key=keyfiles.load_public_key(d.shuffler_signing_pub, "ed25519"),
                max_message_bytes=_MAX_MESSAGE_BYTES, timeout=self._timeout))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()

    def exchange(self, payloads: Sequence[bytes], arrays: Sequence[np.ndarray], round_id: int) -> list[bytes]:
        """Seal one round's payloads (client i seals payload i), shuffle them in the shuffler process, fetch and
        open the permuted batch.

        Args:
            payloads: the round's report payloads, one per client (``n_clients`` of them).
            arrays: the round's model (its digest is bound into every envelope).
            round_id: the round id bound into every envelope (a fresh one per round).

        Returns:
            The opened payloads, in the shuffler's order.

        Raises:
            ValueError: not one payload per client; RuntimeError: the shuffler did not accept every report.
        """
        from shuffledp.shuffler.envelope import open_inner, seal

        if len(payloads) != self.n_clients:
            raise ValueError(f"need one payload per enrolled client ({self.n_clients}), got {len(payloads)}")
        digest = arrays_digest([np.asarray(a) for a in arrays])
        envelopes = [seal(bytes(p), server_public_key=self._server_pk, shuffler_public_key=self._shuffler_pk,
                          signing_key=self._client_keys[i], key_epoch=_KEY_EPOCH, round_id=round_id,
                          model_digest=digest) for i, p in enumerate(payloads)]
        attestation = self._client.submit(round_id=round_id, key_epoch=_KEY_EPOCH, model_digest=digest,
                                          envelopes=envelopes, envelope_length=len(envelopes[0]))
        if attestation.n_accepted != len(envelopes):
            raise RuntimeError(f"the shuffler accepted {attestation.n_accepted} of {len(envelopes)} reports")
        self.batches += 1
        return [open_inner(bytes(inner), server_private_key=self._server_sk, key_epoch=_KEY_EPOCH, round_id=round_id)
                for inner in self._client.fetch(attestation)]
