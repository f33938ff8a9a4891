"""Who may call the drafter, and for which namespaces: TLS / mutual TLS credentials, bearer tokens, namespace binding.

- TLS (``--tls-cert``/``--tls-key``) secures the TCP listeners; with ``--tls-client-ca`` clients must present a
  certificate signed by that CA (mutual TLS). Unix sockets stay plain: their file mode (0660) and group decide who
  may connect (server.py, step_channels.py).
- Bearer tokens (``--auth-token-file``): every Drafter call carries ``authorization: Bearer <token>`` metadata (a
  step channel's hello carries ``"token"``). The file has one token a line, ``<token> <namespace>[,<namespace>...]``
  (``*`` = any namespace; ``#`` starts a comment). A token is compared with every known token in constant time.
- With ``--namespace-from-client-cert`` a TLS client may only use the namespaces named by its certificate: the
  common name and the DNS / URI subject alternative names.
A call's request must name a namespace it may use; Release, shared-memory calls and Propose all do, so one client
can never read, advance or release another namespace's sequences or regions. Health and reflection need no token
(probes and tools); GetInfo needs a valid token but names no namespace.
"""
import hmac
import os
import pathlib
from dataclasses import dataclass

import grpc

from drafter_service.transport.chunked import drain_refused

ANY = "*"
# What the server reads of an upload it refuses for its token or namespace before it answers (chunked.drain_refused;
# less than for a request error: the caller is not known to be a client of this drafter)
AUTH_DRAIN_MAX_BYTES = 16 * 2**20
AUTH_DRAIN_MAX_S = 1.0
DRAFTER_METHOD_PREFIX = "/drafter.v1.Drafter/"


class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TokenEntry:
    token: bytes
    namespaces: frozenset[str]  # may contain ANY


def load_tokens(path: str) -> list[TokenEntry]:
    """Parse a token file (see the module docstring); ValueError naming the line when it is malformed."""
    entries = []
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1]:
            raise ValueError(f"--auth-token-file {path}, line {n}: expected '<token> <namespace>[,<namespace>...]'")
        token, namespaces = parts
        if len(token) < 16:
            raise ValueError(f"--auth-token-file {path}, line {n}: a token must be at least 16 characters")
        entries.append(TokenEntry(token.encode(), frozenset(ns.strip() for ns in namespaces.split(",") if ns)))
    if not entries:
        raise ValueError(f"--auth-token-file {path}: no token in the file")
    return entries


@dataclass
class Authorizer:
    """Decides, per call, the set of namespaces the caller may use (None = any)."""

    tokens: list[TokenEntry] | None = None
    namespace_from_cert: bool = False

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.namespace_from_cert

    def namespaces_for_token(self, token: str | None) -> frozenset[str]:
        """The namespaces a token may use; AuthError UNAUTHENTICATED when it is missing or unknown. Compares
        with every entry (no early exit), each comparison in constant time."""
        if not token:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (metadata 'authorization: "
                                                             "Bearer <token>')")
        given = token.encode()
        found = None
        for e in self.tokens:
            if hmac.compare_digest(e.token, given) and found is None:
                found = e.namespaces
        if found is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        return found

    def allowed(self, metadata, auth_context: dict, peer: str) -> frozenset[str] | None:
        """Namespaces this call may use (None: any)."""
        allowed: frozenset[str] | None = None
        if self.tokens is not None:
            token = None
            for key, value in metadata or ():
                if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                    token = value.removeprefix("Bearer ").strip()
            allowed = self.namespaces_for_token(token)
        if self.namespace_from_cert and not peer.startswith("unix:"):
            names = cert_names(auth_context)
            if not names:
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "no client certificate: this drafter binds "
                                                                 "namespaces to client certificates (mutual TLS)")
            allowed = names if allowed is None or ANY in allowed else allowed & names
        if allowed is not None and ANY in allowed:
            return None
        return allowed

    @staticmethod
    def check(allowed: frozenset[str] | None, namespace: str) -> None:
        if allowed is not None and namespace not in allowed:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"namespace {namespace!r} is not one this client may "
                                                               f"use")


def cert_names(auth_context: dict) -> frozenset[str]:
    """Common name and subject alternative names of the peer's certificate (empty without one)."""
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for v in auth_context.get(key, []) if auth_context else []:
            names.add(v.decode() if isinstance(v, bytes) else str(v))
    return frozenset(names)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the caller of every Drafter method (health and reflection pass) before the servicer runs; requests
    are checked after they are decoded: their ``namespace`` must be one the caller may use."""

    def __init__(self, authorizer: Authorizer):
        self.auth = authorizer

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(DRAFTER_METHOD_PREFIX):
            return handler
        auth = self.auth

        async def allowed_or_abort(context, before_abort=None):
            """before_abort(): awaited before a refusal (an upload: read what is left of it; see upload below)."""
            try:
                return auth.allowed(context.invocation_metadata(), context.auth_context(), context.peer())
            except AuthError as e:
                if before_abort is not None:
                    await before_abort()
                await context.abort(e.code, e.message)

        async def check_or_abort(allowed, request, context, before_abort=None):
            namespace = getattr(request, "namespace", None)  # (a ProposeChunked chunk: its request's, first only)
            if namespace is not None:
                try:
                    auth.check(allowed, namespace)
                except AuthError as e:
                    if before_abort is not None:
                        await before_abort()
                    await context.abort(e.code, e.message)

        async def checked(requests, allowed, context, before_abort=None):
            async for request in requests:
                await check_or_abort(allowed, request, context, before_abort)
                yield request

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            admin = details.method == DRAFTER_METHOD_PREFIX + "Drain"

            async def unary(request, context):
                allowed = await allowed_or_abort(context)
                if admin and allowed is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "Drain needs a token for any namespace "
                                                                           "('*')")
                await check_or_abort(allowed, request, context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(request_iterator, context):
                allowed = await allowed_or_abort(context)
                async for reply in inner_stream(checked(request_iterator, allowed, context), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                         handler.response_serializer)
        if handler.stream_unary is not None:  # ProposeChunked: the request rides in its first chunk
            inner_upload = handler.stream_unary

            async def upload(request_iterator, context):
                # A refused upload is read to its end (bounded) before the answer: answered while the client still
                # writes, grpcio's asyncio client reports INTERNAL in place of the status (grpc/grpc#36066), which
                # a client takes for a drafter fault (chunked.drain_refused)
                requests = aiter(request_iterator)
                drain = lambda: drain_refused(requests, AUTH_DRAIN_MAX_BYTES, AUTH_DRAIN_MAX_S)  # noqa: E731
                allowed = await allowed_or_abort(context, drain)
                return await inner_upload(checked(requests, allowed, context, drain), context)

            return grpc.stream_unary_rpc_method_handler(upload, handler.request_deserializer,
                                                        handler.response_serializer)
        inner_out = handler.unary_stream  # the last kind (the Drafter has none today): checked all the same

        async def replies(request, context):
            allowed = await allowed_or_abort(context)
            await check_or_abort(allowed, request, context)
            async for reply in inner_out(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(replies, handler.request_deserializer,
                                                    handler.response_serializer)


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS credentials for the TCP listeners; with client_ca, clients must present a certificate it signed."""
    root = pathlib.Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(pathlib.Path(key).read_bytes(), pathlib.Path(cert).read_bytes())],
                                       root_certificates=root, require_client_auth=root is not None)


SOCKET_MODE = 0o660  # Unix sockets: owner and group only


def restrict_socket(path: str, group: str | None) -> None:
    """Mode 0660 and (when given) the group of a Unix socket the drafter listens on: who may connect is decided by
    the file system (docs/deployment.md, Security)."""
    if group is not None:
        import grp

        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"--socket-group {group!r}: no such group") from None
        os.chown(path, -1, gid)
    os.chmod(path, SOCKET_MODE)
