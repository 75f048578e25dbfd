"""The transport ceiling of ``bench_shuffler.py``: plain gRPC over the same mTLS credentials, a do-nothing sink for
Submit and a do-nothing source for Fetch, in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from shuffler_runs import EnvelopeFile, Keys, cpu_seconds

from shuffledp.shuffler import wire
from shuffledp.shuffler.client import FETCH_METHOD, SUBMIT_METHOD
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, INNER_OVERHEAD
from shuffledp.shuffler.service import grpc_options, message_limit, packing_for

_BASELINE_SERVER = textwrap.dedent(
    """
    import itertools, sys
    from concurrent import futures
    import grpc
    from shuffledp.shuffler import shuffler_pb2 as pb
    from shuffledp.shuffler import wire
    from shuffledp.shuffler.service import SERVICE_NAME, grpc_options
    ca, cert, key, max_envelope, port_file, heap = sys.argv[1:7]
    options = grpc_options(int(max_envelope))  # the shuffler's own message limits
    if heap == "tuned":  # as the shuffler service does (config heap_tuning)
        from shuffledp.shuffler.heap import tune_heap
        tune_heap(dict(options)["grpc.max_receive_message_length"])
    def submit(messages, ctx):
        # a sink: takes each message as the raw bytes gRPC delivers (as the shuffler's Submit does) and keeps
        # only their total length
        n = 0
        for raw in messages:
            n += len(raw)
        return pb.SubmitResponse(statement=str(n).encode())
    def fetch(req, ctx):
        # a source: batch_id = count (8 bytes) || item length (8 bytes) || packing (8 bytes); the items are grouped
        # as the shuffler groups them (wire.packed) and each message is encoded once and sent again and again (no
        # file read, no copy in Python, no verification)
        count, length, packing = (int.from_bytes(req.batch_id[i : i + 8], "big") for i in (0, 8, 16))
        item = bytes(length)
        group = next(wire.packed(itertools.repeat(item, count), packing), [])
        if not group:
            return
        full = wire.encode_repeated_bytes_field(1, group)
        for _ in range(count // len(group)):
            yield full
        if count % len(group):
            yield wire.encode_repeated_bytes_field(1, group[: count % len(group)])
    handlers = {
        "Submit": grpc.stream_unary_rpc_method_handler(
            submit, request_deserializer=None, response_serializer=pb.SubmitResponse.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=None),
    }
    s = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    creds = grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())],
                                        root_certificates=open(ca, "rb").read(), require_client_auth=True)
    port = s.add_secure_port("127.0.0.1:0", creds)
    s.start()
    open(port_file, "w").write(str(port))
    s.wait_for_termination()
    """
)


class Baseline:
    """Plain gRPC over the same mTLS credentials in a child process: a do-nothing sink for client-streaming and a
    do-nothing source for server-streaming (the transport ceiling). Started once per size, so that its runs can
    alternate with the shuffler's in one invocation; a context manager."""

    def __init__(self, keys: Keys, max_envelope: int, workdir: Path, *, heap_tuning: bool) -> None:
        import grpc

        from shuffledp.shuffler import shuffler_pb2 as pb

        #: CPU seconds per run: (server submit, server fetch, client submit, client fetch)
        self.cpu: list[tuple[float, float, float, float]] = []
        #: the size of a packed message, as the shuffler's client packs Submit and the shuffler packs Fetch for
        #: a peer with the shuffler's own message limit
        self.packing = packing_for(message_limit(max_envelope))
        port_file = workdir / "baseline.port"
        port_file.unlink(missing_ok=True)
        d = keys.d
        self.proc = subprocess.Popen([sys.executable, "-c", _BASELINE_SERVER, str(d.ca_cert), str(d.shuffler_cert),
                                      str(d.shuffler_tls_key), str(max_envelope), str(port_file),
                                      "tuned" if heap_tuning else "default"])
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("baseline server did not start")
                time.sleep(0.05)
            port = int(port_file.read_text())
            creds = grpc.ssl_channel_credentials(root_certificates=keys.ca, private_key=keys.key,
                                                 certificate_chain=keys.cert)
            self.channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=grpc_options(max_envelope))
            # raw bytes both ways, as ShufflerClient sends Submit and reads Fetch
            self.submit = self.channel.stream_unary(SUBMIT_METHOD, request_serializer=None,
                                                    response_deserializer=pb.SubmitResponse.FromString)
            self.fetch = self.channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString,
                                                   response_deserializer=None)
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except BaseException:
            self.close()
            raise

    def run(self, envs: EnvelopeFile) -> tuple[float, float]:
        """Seconds to client-stream the envelopes to the sink, grouped and encoded as ``ShufflerClient.submit``
        sends them (:attr:`packing`), and seconds to server-stream as many inner-sized items back from the source,
        packed as Fetch packs them and decoded as ``ShufflerClient.fetch`` decodes them: the transport's own cost
        in each direction, with no work of the sink or source per message beyond gRPC's. The CPU seconds of the
        sink/source process and of this client in each phase are appended to :attr:`cpu`
        (``(server submit, server fetch, client submit, client fetch)``)."""
        from shuffledp.shuffler import shuffler_pb2 as pb

        inner_length = envs.length - ENVELOPE_OVERHEAD + INNER_OVERHEAD
        me = os.getpid()
        sent = envelopes = 0

        def messages() -> Iterator[bytes]:
            nonlocal sent, envelopes
            for group in wire.packed(iter(envs), self.packing):
                raw = (wire.encode_bytes_field(2, group[0]) if len(group) == 1
                       else wire.encode_batch_message(4, 1, group))  # as SubmitStream._encode_group
                sent += len(raw)
                envelopes += len(group)
                yield raw

        s0, c0 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        t0 = time.perf_counter()
        resp = self.submit(messages())
        t1 = time.perf_counter()
        s1, c1 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        got = 0
        t2 = time.perf_counter()
        request = pb.FetchRequest(batch_id=b"".join(x.to_bytes(8, "big")
                                                    for x in (envs.count, inner_length, self.packing)))
        for raw in self.fetch(request):
            for item in wire.decode_repeated_bytes_field(raw, 1) or []:
                got += len(item)
        t3 = time.perf_counter()
        s3, c3 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        self.cpu.append((s1 - s0, s3 - s1, c1 - c0, c3 - c1))
        if envelopes != envs.count:
            raise RuntimeError(f"baseline client sent {envelopes} envelopes, expected {envs.count}")
        if int(resp.statement) != sent:
            raise RuntimeError(f"baseline sink received {int(resp.statement)} bytes, {sent} were sent")
        if got != envs.count * inner_length:
            raise RuntimeError(f"baseline source sent {got} bytes, expected {envs.count * inner_length}")
        return t1 - t0, t3 - t2

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)

    def __enter__(self) -> "Baseline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
