"""Audit trials end to end: every client seals its report with the clients' real code
(:func:`shuffledp.clients.core.make_envelope`: the pinned mechanism's ``randomize``, then
:func:`shuffledp.shuffler.envelope.seal`), a real shuffler process (:class:`shuffledp.shuffler.process.ShufflerProcess`,
mTLS, a key directory from :func:`shuffledp.shuffler.keys.init_key_directory`) verifies, shuffles and releases the
batch, and the server side opens and decodes each inner ciphertext as :mod:`shuffledp.server.rounds` does.

What the server sees is the decoded multiset; :func:`shuffled_multisets` returns it, so that the in-process path
of :mod:`shuffledp.deploy.audit_privacy_pipelines` can be checked against it (for fixed noise keys, the two
multisets are equal: :func:`in_process_multiset`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shuffledp.clients.core import make_envelope
from shuffledp.clients.messages import TrainConfig, arrays_digest
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.settings import PinnedSettings
from shuffledp.deploy.audit_privacy_pipelines import AuditInstance, LaplacePipeline

__all__ = ["shuffled_multisets", "in_process_multiset", "client_inputs"]

_KEY_EPOCH = 0


def client_inputs(instance: AuditInstance, hyp: str) -> list[np.ndarray]:
    """The n clients' inputs for hypothesis ``hyp``: the canary's first, then the n - 1 others'.

    Returns:
        A list of float64 vectors of length ``dim``.
    """
    inputs = instance.inputs()
    if hyp not in ("a", "b"):
        raise ValueError(f"hypothesis must be 'a' or 'b', got {hyp!r}")
    return [inputs[hyp]] + [inputs["o"]] * (instance.n - 1)


def _model(instance: AuditInstance) -> list[np.ndarray]:
    # the "model" the server sends: only its size (dim parameters) and its digest (the binding) matter here
    return [np.zeros((1, instance.dim), dtype=np.float32)]


def in_process_multiset(instance: AuditInstance, hyp: str, noise_keys: Sequence[bytes]) -> np.ndarray:
    """The multiset the server would decode, computed in-process with the client's mechanism under the fixed
    CSPRNG keys ``noise_keys`` (one per client; test use only).

    Returns:
        int64 grid values, shape ``(n, dim)``, rows sorted lexicographically.
    """
    pipe = LaplacePipeline(instance)
    rows = []
    for vec, key in zip(client_inputs(instance, hyp), noise_keys, strict=True):
        pipe_i = LaplacePipeline(instance, rng=ChaCha20Rng(key))
        rows.append(pipe.decode(pipe_i.mechanism.randomize(vec)))
    return _sorted(np.stack(rows))


def _sorted(y: np.ndarray) -> np.ndarray:
    return y[np.lexsort(y.T[::-1])]


def shuffled_multisets(instance: AuditInstance, hyps: Sequence[str], *, workdir: str | Path | None = None,
                       noise_keys: Sequence[Sequence[bytes]] | None = None,
                       startup_timeout: float = 120.0) -> list[np.ndarray]:
    """Run one round per entry of ``hyps`` through a real shuffler process and return the decoded multisets.

    Args:
        instance: the audited pair (the real ``laplace`` mechanism).
        hyps: the hypothesis of each round (``"a"`` or ``"b"``).
        workdir: where the key directory goes (default: a temporary directory, removed afterwards).
        noise_keys: per round, one fixed CSPRNG key per client (tests only); default: each client's mechanism
            keys its CSPRNG from ``os.urandom``.
        startup_timeout: seconds to wait for the shuffler.

    Returns:
        Per round, int64 grid values of shape ``(n, dim)``, rows sorted lexicographically (the release order is
        the shuffler's permutation; the sort makes multisets comparable).
    """
    from shuffledp.shuffler import keys as keyfiles
    from shuffledp.shuffler.client import ShufflerClient
    from shuffledp.shuffler.envelope import open_inner
    from shuffledp.shuffler.process import ShufflerProcess

    if noise_keys is not None and len(noise_keys) != len(hyps):
        raise ValueError("noise_keys needs one list of keys per round")
    with tempfile.TemporaryDirectory(prefix="audit-privacy-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        d = keyfiles.init_key_directory(root / "keys", instance.n, key_epoch=_KEY_EPOCH)
        server_pk = keyfiles.load_public_key(d.server_hpke_pub, "x25519")
        shuffler_pk = keyfiles.load_public_key(d.shuffler_hpke_pub, "x25519")
        server_sk = keyfiles.load_private_key(d.server_hpke_key, "x25519")
        client_keys = [keyfiles.load_private_key(d.client_key(i), "ed25519") for i in range(instance.n)]
        tls = (d.ca_cert.read_bytes(), d.serverapp_cert.read_bytes(), d.serverapp_tls_key.read_bytes())
        decoder = LaplacePipeline(instance)
        arrays = _model(instance)
        digest = arrays_digest(arrays)
        out = []
        with ShufflerProcess(d.config, root_certificate=tls[0], client_certificate=tls[1], client_key=tls[2],
                             startup_timeout=startup_timeout) as proc, \
                ShufflerClient(proc.address, root_certificate=tls[0], client_certificate=tls[1], client_key=tls[2],
                               shuffler_verify_key=keyfiles.load_public_key(d.shuffler_signing_pub, "ed25519"),
                               max_message_bytes=8 * 1024 * 1024) as client:
            for r, hyp in enumerate(hyps):
                round_id = r + 1
                cfg = TrainConfig(round=round_id, key_epoch=_KEY_EPOCH, eps0=instance.eps0, clip_l1=instance.clip)
                envelopes = []
                for i, vec in enumerate(client_inputs(instance, hyp)):
                    pinned = PinnedSettings(eps0=instance.eps0, clip_l1=instance.clip, client_key=client_keys[i],
                                            server_public_key=server_pk, shuffler_public_key=shuffler_pk,
                                            partition_id=i, num_partitions=instance.n)
                    rng = ChaCha20Rng(noise_keys[r][i]) if noise_keys is not None else None
                    envelopes.append(make_envelope(arrays, cfg, pinned, update=vec, rng=rng))
                attestation = client.submit(round_id=round_id, key_epoch=_KEY_EPOCH, model_digest=digest,
                                            envelopes=envelopes, envelope_length=len(envelopes[0]))
                if attestation.n_accepted != instance.n:
                    raise RuntimeError(f"the shuffler accepted {attestation.n_accepted} of {instance.n} reports")
                rows = [decoder.decode(open_inner(bytes(inner), server_private_key=server_sk, key_epoch=_KEY_EPOCH,
                                                  round_id=round_id))
                        for inner in client.fetch(attestation)]
                out.append(_sorted(np.stack(rows)))
    return out
