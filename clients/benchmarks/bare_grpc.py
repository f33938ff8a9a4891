"""The transport floor of a unary step: the same request and reply bytes through a bare grpc.aio server.

What an engine on another node pays per step by unary gRPC is the drafter's step, gRPC's own transport, and the
Python of both sides around them (the client's packing and parsing, the drafter's parse, its hand-offs to and from
the step thread). This server receives the very messages the client library sends for a step (one Propose message,
or ProposeChunked's header and chunks), does nothing with them, and answers with as many bytes as the drafter's
reply (the ``reply-bytes`` call metadata): what is left is gRPC's Python binding and the socket alone. It runs as
the drafter does (a process of its own, its malloc setting, its message limits, uvloop where installed), over the
same kind of socket, so that the in-process step plus this round trip is the unary path's floor: as long as the step
starts once the whole request is in, no change inside the drafter or the client library can bring the unary step below
it (bench_step --grpc-floor times it in each round).
"""
import asyncio
import multiprocessing
import time

SERVICE = "bench.Bare"
REPLY_BYTES_KEY = "reply-bytes"
MAX_REPLY_BYTES = 64 << 20
LARGE_MESSAGES = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def serve(address: str, max_message_bytes: int, ready) -> None:
    """Serve Call (unary) and Upload (client stream) on address until killed; ready is set once it listens."""
    import grpc

    try:  # the drafter's own setting (runtime.keep_large_blocks_in_heap): large messages from the heap
        from drafter_service.runtime import keep_large_blocks_in_heap
        keep_large_blocks_in_heap()
    except ImportError:
        pass

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                          ("grpc.max_send_message_length", max_message_bytes),
                                          ("grpc.so_reuseport", 0)])
        replies = bytes(MAX_REPLY_BYTES)
        view = memoryview(replies)

        def reply(context) -> bytes:
            n = dict(context.invocation_metadata()).get(REPLY_BYTES_KEY, "0")
            return view[: min(int(n), MAX_REPLY_BYTES)].tobytes()

        async def call(request: bytes, context) -> bytes:
            return reply(context)

        async def upload(messages, context) -> bytes:
            async for _ in messages:
                pass
            return reply(context)

        identity = dict(request_deserializer=None, response_serializer=None)  # (bytes in, bytes out)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(call, **identity),
            "Upload": grpc.stream_unary_rpc_method_handler(upload, **identity)}),))
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        await server.wait_for_termination()

    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


class BareServer:
    """The bare server in a process of its own (spawned: the caller may hold a CUDA context), for a with-block."""

    def __init__(self, address: str, max_message_bytes: int = 1 << 30, ready_timeout_s: float = 60.0):
        self.address = address
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        self.process = ctx.Process(target=serve, args=(address, max_message_bytes, ready), daemon=True)
        self.process.start()
        if not ready.wait(ready_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the bare gRPC server did not listen on {address} within {ready_timeout_s} s")

    def close(self) -> None:
        self.process.kill()
        self.process.join(10)

    def __enter__(self) -> "BareServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BareClient:
    """Calls of the bare server with given request messages and reply size."""

    def __init__(self, channel):
        self._call = channel.unary_unary(f"/{SERVICE}/Call")
        self._upload = channel.stream_unary(f"/{SERVICE}/Upload")

    async def round_trip(self, messages: "list[bytes]", chunked: bool, reply_bytes: int) -> float:
        """Seconds for one call: messages[0] as a unary request (chunked False), or all of them on a client stream
        (chunked True, as ProposeChunked sends them); the answer has reply_bytes bytes."""
        metadata = ((REPLY_BYTES_KEY, str(reply_bytes)),)
        t0 = time.perf_counter()
        if chunked:
            async def pieces():
                for m in messages:
                    yield m
            answer = await self._upload(pieces(), metadata=metadata)
        else:
            answer = await self._call(messages[0], metadata=metadata)
        t = time.perf_counter() - t0
        if len(answer) != reply_bytes:
            raise RuntimeError(f"the bare server answered {len(answer)} bytes, not {reply_bytes}")
        return t
