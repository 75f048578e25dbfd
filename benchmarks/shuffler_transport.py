"""The transport ceiling of ``bench_shuffler.py``: plain gRPC over the same mTLS credentials, a do-nothing sink for
Submit and a do-nothing source for Fetch, in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shuffler_runs import EnvelopeFile, Keys, cpu_seconds

from shuffledp.shuffler import wire
from shuffledp.shuffler.client import FETCH_METHOD
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, INNER_OVERHEAD

_BASELINE_SERVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from shuffledp.shuffler import shuffler_pb2 as pb, shuffler_pb2_grpc as pb_grpc
    from shuffledp.shuffler import wire
    ca, cert, key, limit, port_file, heap = sys.argv[1:7]
    if heap == "tuned":  # as the shuffler service does (config heap_tuning)
        from shuffledp.shuffler.heap import tune_heap
        tune_heap(int(limit))
    class Sink(pb_grpc.ShufflerServicer):
        def Submit(self, it, ctx):
            n = 0
            for req in it:
                n += len(req.envelope)
            return pb.SubmitResponse(statement=str(n).encode())
        def Fetch(self, req, ctx):
            # a source: batch_id = count (8 bytes) || item length (8 bytes); the items are packed as the
            # shuffler packs them (wire.packed), from one bytes object (no file read, no verification)
            count, length = int.from_bytes(req.batch_id[:8], "big"), int.from_bytes(req.batch_id[8:], "big")
            item = bytes(length)
            for group in wire.packed((item for _ in range(count)), wire.PACKED_MESSAGE_BYTES):
                yield pb.FetchResponse(inner=group)
    s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", int(limit)),
                                                            ("grpc.max_send_message_length",
                                                             max(int(limit), 2 * wire.PACKED_MESSAGE_BYTES))])
    pb_grpc.add_ShufflerServicer_to_server(Sink(), s)
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

    def __init__(self, keys: Keys, max_msg: int, workdir: Path, *, heap_tuning: bool) -> None:
        import grpc

        from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc

        #: CPU seconds per run: (server submit, server fetch, client submit, client fetch)
        self.cpu: list[tuple[float, float, float, float]] = []
        port_file = workdir / "baseline.port"
        port_file.unlink(missing_ok=True)
        d = keys.d
        self.proc = subprocess.Popen([sys.executable, "-c", _BASELINE_SERVER, str(d.ca_cert), str(d.shuffler_cert),
                                      str(d.shuffler_tls_key), str(max_msg + 1024), str(port_file),
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
            self.channel = grpc.secure_channel(
                f"127.0.0.1:{port}", creds,
                options=[("grpc.max_send_message_length", max_msg + 1024),
                         ("grpc.max_receive_message_length", max(max_msg + 1024, 2 * wire.PACKED_MESSAGE_BYTES))])
            self.stub = pb_grpc.ShufflerStub(self.channel)
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except BaseException:
            self.close()
            raise

    def run(self, envs: EnvelopeFile) -> tuple[float, float]:
        """Seconds to client-stream the envelopes to the sink (one per message, as protobuf messages), and seconds
        to server-stream as many inner-sized items back from the source, packed as Fetch packs them and decoded
        as ``ShufflerClient.fetch`` decodes them: the transport's own cost in each direction. The CPU seconds of
        the sink/source process and of this client in each phase are appended to :attr:`cpu`
        (``(server submit, server fetch, client submit, client fetch)``)."""
        from shuffledp.shuffler import shuffler_pb2 as pb

        inner_length = envs.length - ENVELOPE_OVERHEAD + INNER_OVERHEAD
        me = os.getpid()
        s0, c0 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        t0 = time.perf_counter()
        resp = self.stub.Submit(pb.SubmitRequest(envelope=bytes(e)) for e in envs)
        t1 = time.perf_counter()
        s1, c1 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        raw_fetch = self.channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString,
                                              response_deserializer=None)
        got = 0
        t2 = time.perf_counter()
        for raw in raw_fetch(pb.FetchRequest(batch_id=envs.count.to_bytes(8, "big") + inner_length.to_bytes(8, "big"))):
            for item in wire.decode_repeated_bytes_field(raw, 1) or []:
                got += len(item)
        t3 = time.perf_counter()
        s3, c3 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        self.cpu.append((s1 - s0, s3 - s1, c1 - c0, c3 - c1))
        if int(resp.statement) != envs.count * envs.length:
            raise RuntimeError("baseline sink received the wrong number of bytes")
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
