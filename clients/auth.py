"""Client credentials: TLS / mutual TLS to a drafter's TCP listener, and a bearer token on every call.

    from drafter_client import DrafterClient
    from drafter_client.auth import tls_credentials

    creds = tls_credentials("ca.pem", cert="engine.pem", key="engine-key.pem")   # cert/key: mutual TLS only
    async with DrafterClient("drafter:50061", namespace="engine-0", credentials=creds, token=TOKEN) as c: ...

The token goes as ``authorization: Bearer <token>`` metadata (docs/deployment.md, Security); over a Unix socket
it works without TLS, the socket's file mode guarding the connection.
"""
import pathlib

import grpc


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials: ca verifies the drafter (None: the system's roots); cert + key (PEM paths) present
    this client's certificate for mutual TLS."""
    def read(path):
        return pathlib.Path(path).read_bytes() if path else None

    if (cert is None) != (key is None):
        raise ValueError("cert and key go together")
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries a bearer token (None without one)."""
    return (("authorization", f"Bearer {token}"),) if token else None
