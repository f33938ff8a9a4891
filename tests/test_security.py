"""Identity and isolation: TLS, mutual TLS with namespaces bound to client certificates, bearer tokens bound to
namespaces (gRPC calls and step-channel hellos), Unix sockets 0660, reflection off unless asked for.

The tests make their own CA and certificates with the openssl command line (skipped, saying so, without it).
"""
import dataclasses
import os
import shutil
import stat
import subprocess

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_client.auth import tls_credentials
from drafter_client.messages import ChunkedRequest, _request_without_states
from drafter_client.protocol import pb
from drafter_client.step_channel import StepChannel, StepChannelError

H = 64
TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
TOKEN_ANY = "token-any-0123456789abcd"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command is not installed: no certificates to test TLS with")


def step(sid: str, p: int = 0) -> SequenceStep:
    return SequenceStep(sid, p, [1, 2, 3], torch.randn(3, H), 4, 2)


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost / 127.0.0.1, client certificates with CN engine-a / engine-b."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, subject, ext in [("server", "/CN=localhost", ["-extfile", "server.ext"]),
                               ("engine-a", "/CN=engine-a", []), ("engine-b", "/CN=engine-b", [])]:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                subject, cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)
    return d


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(f"# token namespaces\n{TOKEN_A} ns-a\n{TOKEN_B} ns-b,ns-b2\n{TOKEN_ANY} *\n")
    return path


async def drafts_ok(client: DrafterClient, sid: str) -> None:
    r = await client.propose([step(sid)])
    assert r.sequences[0].ok, r.sequences[0].message


async def test_tls_and_mutual_tls_bind_namespaces_to_certificates(tiny_model, pki, tmp_path):
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem"), namespace_from_client_cert=True)
    with ServerThread(cfg) as s:
        port = s.tcp.rsplit(":", 1)[1]
        address = f"localhost:{port}"
        creds_a = tls_credentials(str(pki / "ca.pem"), str(pki / "engine-a.pem"), str(pki / "engine-a.key"))
        async with DrafterClient(address, namespace="engine-a", credentials=creds_a) as a:
            await drafts_ok(a, "s1")
            a.namespace = "engine-b"  # the certificate says engine-a
            with pytest.raises(DrafterError) as e:
                await a.propose([step("s1")])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "engine-b" in e.value.message
            with pytest.raises(DrafterError) as e:  # nor release another namespace's sequences
                await a.release(["s1"])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        # no client certificate: the TLS handshake fails; a plaintext client gets nothing either
        # (raise_on_error: the default client would answer "no drafts" for an unreachable drafter)
        async with DrafterClient(address, namespace="engine-a", raise_on_error=True,
                                 credentials=tls_credentials(str(pki / "ca.pem"))) as nocert:
            with pytest.raises(DrafterError) as e:
                await nocert.propose([step("s2")], timeout=5)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
        async with DrafterClient(address, namespace="engine-a", raise_on_error=True) as plain:
            with pytest.raises(DrafterError) as e:
                await plain.propose([step("s2")], timeout=5)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
        # engine-b's certificate reaches engine-b's namespace only; engine-a's sequence is untouched
        creds_b = tls_credentials(str(pki / "ca.pem"), str(pki / "engine-b.pem"), str(pki / "engine-b.key"))
        async with DrafterClient(address, namespace="engine-b", credentials=creds_b) as b:
            await drafts_ok(b, "s1")
            assert (await b.release(["s1"])).released == 1
        async with DrafterClient(address, namespace="engine-a", credentials=creds_a) as a:
            assert (await a.release(["s1"])).released == 1  # still there after engine-b's release
        # an upload spread over several connections: each extra connection is TLS with the same certificate, and
        # its part's namespace is held to it like a request's
        g = torch.Generator().manual_seed(3)
        big = SequenceStep("big", 0, torch.randint(0, 512, (300,), generator=g), torch.randn(300, H, generator=g), 4, 2)
        async with DrafterClient(address, namespace="engine-a", credentials=creds_a, chunk_min_bytes=0,
                                 upload_streams=3, upload_streams_min_bytes=0) as a:
            assert (await a.propose([big])).sequences[0].ok and a.steps_spread == 1
            a.namespace = "engine-b"  # the certificate says engine-a: the first call and the extra ones are refused
            with pytest.raises(DrafterError) as e:
                await a.propose([dataclasses.replace(big, sequence_id="big2")])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value


async def test_tls_server_without_client_ca_accepts_any_tls_client(tiny_model, pki, tmp_path):
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    with ServerThread(cfg) as s:
        address = f"localhost:{s.tcp.rsplit(':', 1)[1]}"
        async with DrafterClient(address, namespace="x", credentials=tls_credentials(str(pki / "ca.pem"))) as c:
            await drafts_ok(c, "s")
        async with DrafterClient(s.uds, namespace="x") as c:  # the Unix socket stays plain
            await drafts_ok(c, "u")


async def test_bearer_tokens_are_bound_to_namespaces(tiny_model, tokens_file, tmp_path):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, auth_token_file=str(tokens_file))) as s:
        async with DrafterClient(s.tcp, namespace="ns-a") as none:
            with pytest.raises(DrafterError) as e:
                await none.propose([step("s")])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "token" in e.value.message
            with pytest.raises(DrafterError) as e:
                await none.get_info()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            await none.wait_ready(10)  # health needs no token (probes)
        async with DrafterClient(s.tcp, namespace="ns-a", token="token-a-0123456789abcdeX") as wrong:
            with pytest.raises(DrafterError) as e:
                await wrong.propose([step("s")])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "unknown" in e.value.message
        async with DrafterClient(s.uds, namespace="ns-a", token=TOKEN_A) as a:
            await a.get_info()
            await drafts_ok(a, "s")
            async with a.stream() as session:  # streams are checked per message
                r = await session.propose([step("s", 0)])
                assert r.sequences[0].ok
        async with DrafterClient(s.uds, namespace="ns-a", token=TOKEN_B) as b_as_a:
            with pytest.raises(DrafterError) as e:
                await b_as_a.propose([step("s", 3)])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(DrafterError) as e:
                await b_as_a.release(["s"])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(DrafterError) as e:
                async with b_as_a.stream() as session:
                    await session.propose([step("s", 3)])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(DrafterError) as e:
                await b_as_a.shared_memory_status()
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        async with DrafterClient(s.uds, namespace="ns-b2", token=TOKEN_B) as b:
            await drafts_ok(b, "t")
        async with DrafterClient(s.uds, namespace="anything", token=TOKEN_ANY) as anyone:
            await drafts_ok(anyone, "t")
        # step channels: the hello carries the token
        path = s.server.config.step_channel_path()
        with pytest.raises(StepChannelError) as e:
            StepChannel.open(path, "ns-a", 1 << 16, 1 << 16)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(StepChannelError) as e:
            StepChannel.open(path, "ns-a", 1 << 16, 1 << 16, token=TOKEN_B)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        async with DrafterClient(s.uds, namespace="ns-a", token=TOKEN_A) as a:
            assert await a.open_step_channel(request_bytes=1 << 16, reply_bytes=1 << 16)
            r = await a.propose([step("s", 0)])
            assert r.sequences[0].ok and a.steps_through_channel == 1
            with pytest.raises(DrafterError) as e:  # Drain is for operators: a '*' token
                await a.drain(1.0)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        async with DrafterClient(s.uds, namespace="ops", token=TOKEN_ANY) as ops:
            assert (await ops.drain(1.0)).grace_seconds == 1.0


async def test_chunked_uploads_are_checked_like_every_other_call(tiny_model, tokens_file, tmp_path):
    """ProposeChunked (a client stream whose first chunk carries the request): no token is UNAUTHENTICATED, a
    namespace the token does not cover is PERMISSION_DENIED, and neither touches the namespace's sequences."""
    head, target = tiny_model
    g = torch.Generator().manual_seed(5)
    prompt = SequenceStep("c", 0, torch.randint(0, 512, (300,), generator=g), torch.randn(300, H, generator=g), 4, 2)
    with ServerThread(make_config(head, target, tmp_path, auth_token_file=str(tokens_file))) as s:
        async with DrafterClient(s.tcp, namespace="ns-a", token=TOKEN_A, chunk_min_bytes=0) as a:
            r = await a.propose([prompt])
            assert r.sequences[0].ok and r.sequences[0].committed_length == 300 and a.steps_chunked == 1
        one_token = SequenceStep("c", 0, [1], torch.zeros(1, H), 2, 0)  # would restart "c" at position 0
        restart = ChunkedRequest(_request_without_states("ns-a", [one_token], 9), [one_token.hidden_states])
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (TOKEN_B, grpc.StatusCode.PERMISSION_DENIED)):
            async with DrafterClient(s.tcp, namespace="ns-a", token=token) as other:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await other._propose_chunked(iter(list(restart.messages(64))), timeout=30, metadata=other._metadata)
                # (the server reads the refused upload to its end before it answers: answered while the client still
                # writes, grpc's asyncio client would report INTERNAL instead of this status, grpc/grpc#36066)
                assert e.value.code() == code, e.value
        # a large refused upload (2 MB in 16 KiB chunks: more than flow control lets out before the answer), many
        # times: every refusal arrives with its own code
        big = SequenceStep("big", 0, torch.randint(0, 512, (8000,), generator=g), torch.randn(8000, H, generator=g), 4, 2)
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (TOKEN_B, grpc.StatusCode.PERMISSION_DENIED)):
            async with DrafterClient(s.tcp, namespace="ns-a", token=token, chunk_min_bytes=0, chunk_bytes=16384,
                                     raise_on_error=True) as other:
                for i in range(8):
                    with pytest.raises(DrafterError) as e:
                        await other.propose([dataclasses.replace(big, sequence_id=f"big{i}")])
                    assert e.value.code == code, (i, e.value)
                assert other.breaker.state == "closed"  # (the caller's error: the drafter is not taken for sick)
        async with DrafterClient(s.tcp, namespace="ns-a", token=TOKEN_A) as a:
            r = await a.propose([step("c", 300)])  # the sequence was not restarted by the refused uploads
            assert r.sequences[0].ok, r.sequences[0].message
        # an upload spread over several calls: every call carries the token, and an extra call's part names its
        # namespace, checked like a request's (another token cannot add bytes to ns-a's upload)
        async with DrafterClient(s.tcp, namespace="ns-a", token=TOKEN_A, chunk_min_bytes=0, upload_streams=3,
                                 upload_streams_min_bytes=0) as a:
            r = await a.propose([dataclasses.replace(prompt, sequence_id="spread")])
            assert r.sequences[0].ok and a.steps_spread == 1
        extra = pb.ProposeChunk(part=pb.UploadPart(namespace="ns-a", upload_id="u", index=1, count=2), offset=0,
                                data=b"x").SerializeToString()
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (TOKEN_B, grpc.StatusCode.PERMISSION_DENIED)):
            async with DrafterClient(s.tcp, namespace="ns-a", token=token) as other:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await other._propose_chunked(iter([extra]), timeout=30, metadata=other._metadata)
                assert e.value.code() == code, e.value


def test_sockets_are_owner_and_group_only_and_group_is_settable(tiny_model, tmp_path):
    head, target = tiny_model
    group = str(os.getgid())
    with ServerThread(make_config(head, target, tmp_path, socket_group=group)) as s:
        for path in (s.uds.removeprefix("unix:"), s.server.config.step_channel_path()):
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660, (path, oct(st.st_mode))
            assert st.st_gid == int(group)


def test_reflection_is_off_unless_asked_for(tiny_model, tmp_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, reflection=False)) as s:
        with grpc.insecure_channel(s.tcp) as ch:
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                list(replies)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_config_refuses_half_tls_settings(tiny_model, tmp_path):
    head, target = tiny_model
    for kw, fragment in [(dict(tls_cert="c.pem"), "--tls-key"), (dict(tls_client_ca="ca.pem"), "--tls-cert"),
                         (dict(namespace_from_client_cert=True), "--tls-client-ca")]:
        with pytest.raises(ValueError, match=fragment):
            make_config(head, target, tmp_path, **kw)
    bad = tmp_path / "tokens"
    bad.write_text("short ns\n")
    from drafter_service.transport.auth import load_tokens

    with pytest.raises(ValueError, match="line 1"):
        load_tokens(str(bad))
    assert pb.DESCRIPTOR.services_by_name["Drafter"]  # (the protocol module imports)
