"""The shared-memory data plane on one node (host shared memory; CUDA IPC is in test_shared_memory_gpu.py).

Drafts through shared memory equal the inline path and the naive reference; every bad reference or registration
is refused with a status naming the field; a namespace can neither use nor alias another's region; a client that
dies has its regions reclaimed within one lease; the client falls back to inline bytes where the drafter cannot
map its memory, and re-registers a ring the drafter lost.
"""
import asyncio
import os
import random
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep, SharedTensorRef
from drafter_client.client import build_request
from drafter_client.shm_ring import HostSegment
from drafter_client.protocol import pb
from fake_engine import FakeSequence
from naive_eagle import NaiveEagle1

H, V = 64, 512
LEASE_S = 2.0  # short, so that a dead client is reclaimed quickly; heartbeats every 2/3 s
STEPS = 24


@pytest.fixture(scope="module")
def shm_server(tiny_model, tmp_path_factory):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path_factory.mktemp("shm"), shm_lease_s=LEASE_S)) as s:
        yield s


def on_loop(server: ServerThread, fn):
    """Run fn on the server's event loop (where the region table lives) and return its result."""

    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), server.loop).result(10)


def regions_of(server: ServerThread, namespace: str) -> list[str]:
    table = server.server.servicer.regions
    return on_loop(server, lambda: sorted(r.name for r in table.regions.values() if r.namespace == namespace))


def step(sid, p=0, m=4, nxt=1, k=3, hidden=None):
    return SequenceStep(sid, p, list(range(10, 10 + m)), hidden if hidden is not None else torch.randn(m, H), nxt, k)


async def refused(coro, code, *fragments):
    with pytest.raises(DrafterError) as e:
        try:
            await coro
        except grpc.aio.AioRpcError as err:
            raise DrafterError(err.code(), err.details()) from None
    assert e.value.code == code, e.value
    for f in fragments:
        assert f in e.value.message, e.value.message


async def register(client: DrafterClient, request: "pb.RegisterSharedMemoryRequest"):
    return await client._call(client._stub.RegisterSharedMemory, request, None)


# ---- drafts ----

async def test_drafts_through_shared_memory_match_inline_and_naive(shm_server, tiny_model):
    naive = NaiveEagle1(*tiny_model)
    rng = random.Random(11)
    async with DrafterClient(shm_server.uds, namespace="eng-shm") as shm, \
            DrafterClient(shm_server.uds, namespace="eng-inline") as inline:
        assert await shm.enable_shared_memory(max_step_tokens=256, dtype=torch.float32, slots=2) == "system"
        assert inline.data_plane == "inline"
        key = shm._ring.store.key
        assert not os.path.exists(f"/dev/shm/{key}"), "the ring's name is unlinked once the drafter mapped it"
        seqs = [FakeSequence(f"s{i}", prompt, H, V, rng, chunk)
                for i, (prompt, chunk) in enumerate([(40, None), (95, 16), (7, None)])]
        session = shm.stream()
        checked = rows = 0
        try:
            for n in range(STEPS):
                steps = [s.next_step(rng.randint(1, 6)) for s in seqs]
                rows += sum(len(st.token_ids) for st in steps)
                got = await (session.propose(steps) if n % 2 else shm.propose(steps))  # stream and unary
                ref = await inline.propose(steps)
                for s, st, a, b in zip(seqs, steps, got.sequences, ref.sequences):
                    assert a.ok and b.ok, (a, b)
                    assert a.committed_length == b.committed_length == s.committed
                    assert a.drafts.tolist() == b.drafts.tolist(), f"{s.seq_id} at p={st.start_position}"
                    if st.num_drafts:
                        assert a.drafts.tolist() == naive.drafts(s.tokens, s.hidden, st.num_drafts)
                        s.last_drafts = a.drafts.tolist()
                        checked += 1
        finally:
            await session.close()
        assert checked >= 50
        assert shm.steps_by_reference == STEPS and shm.steps_inline == 0
        (region,) = await shm.shared_memory_status()
        assert region.kind == pb.SYSTEM and region.references_read == STEPS and region.device == "cpu"
        assert region.bytes_read == rows * H * 4
        # the same reads in the Prometheus text (totals over the whole server: other tests' reads count too)
        text = shm_server.server.runtime.metrics.prometheus_text()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("drafter_shm_"))
        assert float(values["drafter_shm_reads_total"]) >= STEPS
        assert float(values["drafter_shm_read_bytes_total"]) >= rows * H * 4
        assert float(values["drafter_shm_read_seconds_total"]) > 0
        assert float(values["drafter_shm_regions"]) >= 1 and float(values["drafter_shm_region_bytes"]) > 0
        await shm.release([s.seq_id for s in seqs])
        await inline.release([s.seq_id for s in seqs])
    assert regions_of(shm_server, "eng-shm") == []  # close() unregistered the ring


async def test_slots_are_reused_only_after_the_reply(shm_server):
    """One slot: concurrent steps go inline rather than overwrite a slot the drafter may still read."""
    async with DrafterClient(shm_server.tcp, namespace="one-slot") as c:
        assert await c.enable_shared_memory(max_step_tokens=8, dtype=torch.float32, slots=1) == "system"
        rs = await asyncio.gather(*(c.propose([step(f"q{i}")]) for i in range(4)))
        assert all(r.sequences[0].ok for r in rs)
        assert c.steps_by_reference == 1 and c.steps_inline == 3
        assert c._ring.free_slots == 1  # given back after the reply
        async with c.stream() as session:  # two sends before the first recv: the second goes inline
            await session.send([step("q0", p=4, m=1)])
            await session.send([step("q1", p=4, m=1)])
            assert c._ring.free_slots == 0
            assert (await session.recv()).sequences[0].ok and c._ring.free_slots == 1
            assert (await session.recv()).sequences[0].ok
        assert c.steps_by_reference == 2 and c.steps_inline == 4
        # a step larger than a slot (8 rows, rounded up to 4 KiB = 16 rows) goes inline too
        assert c._ring.slot_bytes == 4096
        assert (await c.propose([step("big", m=17)])).sequences[0].ok and c.steps_inline == 5
        await c.release([f"q{i}" for i in range(4)] + ["big"])


# ---- bad references and registrations ----

async def test_bad_references_and_registrations_name_the_field(shm_server):
    seg = HostSegment(4096)  # not unlinked: the aliasing attempts below need its name
    link = f"/dev/shm/drafter-test-link-{os.getpid()}"
    try:
        async with DrafterClient(shm_server.tcp, namespace="alice") as alice, \
                DrafterClient(shm_server.tcp, namespace="mallory") as mallory:
            r = await register(alice, seg.register_request("alice-r", "alice", 0))
            assert r.region.byte_size == 4096 and r.region.kind == pb.SYSTEM
            hidden = torch.randn(4, H)
            seg.bytes[: hidden.numel() * 4].view(torch.float32).copy_(hidden.flatten())
            good = build_request("alice", [step("a")], SharedTensorRef("alice-r", 0, torch.float32, (4, H)))
            by_ref = (await alice._stub.Propose(good)).draft_token_ids
            inline = build_request("alice", [step("b", hidden=hidden)])
            assert (await alice._stub.Propose(inline)).draft_token_ids == by_ref

            def bad(**shm):
                r = pb.ProposeRequest()
                r.CopyFrom(good)
                r.steps[0].sequence_id = "fresh"
                for k, v in shm.items():
                    setattr(r.hidden_states.shm, k, v)
                return r

            P = alice._stub.Propose
            await refused(P(bad(offset=3584)), grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shm", "past the end",
                          "4096 bytes")
            await refused(P(bad(byte_size=1000)), grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shm.byte_size",
                          "1024")
            await refused(P(bad(offset=2)), grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shm.offset", "multiple")
            await refused(P(bad(region="nobody")), grpc.StatusCode.NOT_FOUND, "hidden_states.shm.region", "'nobody'")
            # token ids may come by reference too (copied to the host)
            ids = torch.arange(10, 14, dtype=torch.int64)
            seg.bytes[2048 : 2048 + 32].view(torch.int64).copy_(ids)
            r = pb.ProposeRequest()
            r.CopyFrom(good)
            r.steps[0].sequence_id = "c"
            r.token_ids.CopyFrom(SharedTensorRef("alice-r", 2048, torch.int64, (4,)).to_pb())
            assert (await P(r)).draft_token_ids == by_ref
            r.token_ids.shm.offset = 2048 + 4096
            await refused(P(r), grpc.StatusCode.INVALID_ARGUMENT, "token_ids.shm", "past the end")
            # the same on a stream: an error reply, and the stream stays usable
            call = alice._stub.ProposeStream()
            await call.write(bad(region="nobody"))
            resp = await call.read()
            assert resp.error.code == grpc.StatusCode.NOT_FOUND.value[0] and "hidden_states.shm.region" in resp.error.message
            await call.write(good)
            assert (await call.read()).draft_token_ids == by_ref
            await call.done_writing()

            # another namespace can neither use, take over, unregister nor alias alice's region
            stolen = pb.ProposeRequest()
            stolen.CopyFrom(good)
            stolen.namespace = "mallory"
            await refused(mallory._stub.Propose(stolen), grpc.StatusCode.PERMISSION_DENIED,
                          "hidden_states.shm.region", "another namespace")
            await refused(register(mallory, seg.register_request("mallory-r", "mallory", 0)),
                          grpc.StatusCode.PERMISSION_DENIED, "system", "another namespace")
            await refused(register(mallory, seg.register_request("alice-r", "mallory", 0)),
                          grpc.StatusCode.ALREADY_EXISTS, "'alice-r'")
            await refused(mallory.unregister_shared_memory(["alice-r"]), grpc.StatusCode.PERMISSION_DENIED,
                          "names[0]", "another namespace")
            assert await mallory.shared_memory_status() == []
            assert await mallory.unregister_shared_memory() == []  # "all of mine" touches nobody else's
            # alice registering the same memory twice
            await refused(register(alice, seg.register_request("alice-r2", "alice", 0)),
                          grpc.StatusCode.ALREADY_EXISTS, "already registered as region 'alice-r'")

            # registrations that cannot be mapped
            def req(name="x", byte_size=64, key=None, **kw):
                return pb.RegisterSharedMemoryRequest(namespace="mallory", name=name, byte_size=byte_size,
                                                      system=pb.SystemSharedMemory(key=key or seg.key), **kw)

            await refused(register(mallory, req(key="../../etc/passwd")), grpc.StatusCode.INVALID_ARGUMENT,
                          "system.key")
            await refused(register(mallory, req(key="drafter-no-such-object")), grpc.StatusCode.NOT_FOUND,
                          "system.key", "inline")
            os.symlink(seg.path, link)
            await refused(register(mallory, req(key=os.path.basename(link))), grpc.StatusCode.INVALID_ARGUMENT,
                          "system.key")
            await refused(register(mallory, req(name="bad name!")), grpc.StatusCode.INVALID_ARGUMENT, "name")
            await refused(register(mallory, req(byte_size=0)), grpc.StatusCode.INVALID_ARGUMENT, "byte_size")
            await refused(register(mallory, pb.RegisterSharedMemoryRequest(namespace="mallory", name="x",
                                                                           byte_size=8)),
                          grpc.StatusCode.INVALID_ARGUMENT, "source")
            await refused(register(mallory, pb.RegisterSharedMemoryRequest(
                namespace="mallory", name="x", byte_size=8, cuda=pb.CudaSharedMemory(ipc_handle=b"\0" * 64))),
                grpc.StatusCode.FAILED_PRECONDITION, "cuda", "GPU")

            # an object that shrank under its region: refused, not a SIGBUS
            os.truncate(seg.path, 1024)
            await refused(P(good), grpc.StatusCode.FAILED_PRECONDITION, "shrank")
            os.truncate(seg.path, 4096)

            # unregistered: references are unknown again
            assert await alice.unregister_shared_memory(["alice-r", "never"]) == ["alice-r"]
            await refused(P(good), grpc.StatusCode.NOT_FOUND, "hidden_states.shm.region")
            await alice.release(["a", "b", "c"])
    finally:
        seg.close()
        if os.path.lexists(link):
            os.unlink(link)


async def test_limits_per_namespace(tiny_model, tmp_path):
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path, shm_max_regions_per_namespace=1, shm_max_bytes_per_namespace=8192)
    with ServerThread(cfg) as s:
        a, b = HostSegment(8192), HostSegment(8192)
        try:
            async with DrafterClient(s.tcp, namespace="n") as c:
                too_big = pb.RegisterSharedMemoryRequest(namespace="n", name="big", byte_size=8193,
                                                         system=pb.SystemSharedMemory(key=a.key))
                await refused(register(c, too_big), grpc.StatusCode.RESOURCE_EXHAUSTED, "byte_size", "at most 8192")
                await register(c, a.register_request("r1", "n", 0))
                await refused(register(c, b.register_request("r2", "n", 0)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "at most 1")
        finally:
            a.close()
            b.close()


# ---- lifecycle ----

DOOMED_CLIENT = textwrap.dedent("""
    import asyncio, sys, torch
    from drafter_client import DrafterClient

    async def main():
        c = DrafterClient(sys.argv[1], namespace="doomed")
        plane = await c.enable_shared_memory(max_step_tokens=64, dtype=torch.float32)
        print(plane, c._ring.store.key, flush=True)
        await asyncio.sleep(120)

    asyncio.run(main())
""")


def test_a_client_that_dies_has_its_regions_reclaimed(shm_server):
    expired_before = shm_server.server.servicer.regions.expired_total
    proc = subprocess.Popen([sys.executable, "-c", DOOMED_CLIENT, shm_server.uds], stdout=subprocess.PIPE,
                            text=True)
    try:
        plane, key = proc.stdout.readline().split()
        assert plane == "system"
        (name,) = regions_of(shm_server, "doomed")
        time.sleep(2 * LEASE_S)  # alive: its heartbeat renews the lease
        assert regions_of(shm_server, "doomed") == [name]
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + LEASE_S + 3.0
    while regions_of(shm_server, "doomed") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert regions_of(shm_server, "doomed") == [], "a dead client's region outlived its lease"
    assert shm_server.server.servicer.regions.expired_total == expired_before + 1  # drafter_shm_regions_expired_total
    assert not os.path.exists(f"/dev/shm/{key}")  # and nothing is left in /dev/shm


async def test_client_registers_a_new_ring_when_the_drafter_lost_it(shm_server):
    async with DrafterClient(shm_server.tcp, namespace="phoenix") as c, \
            DrafterClient(shm_server.tcp, namespace="phoenix") as other:
        assert await c.enable_shared_memory(max_step_tokens=8, dtype=torch.float32) == "system"
        first = c._ring.name
        await other.unregister_shared_memory()  # as if the drafter restarted
        deadline = time.monotonic() + 5
        while (c._ring is None or c._ring.name == first) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert c._ring is not None and c._ring.name != first and c.data_plane == "system"
        assert (await c.propose([step("p")])).sequences[0].ok and c.steps_by_reference == 1
        await c.release(["p"])


async def test_falls_back_to_inline_where_the_drafter_cannot_map_the_memory(tiny_model, tmp_path):
    head, target = tiny_model
    other_node = tmp_path / "other-node-shm"  # a drafter that does not see this /dev/shm
    other_node.mkdir()
    with ServerThread(make_config(head, target, tmp_path / "a", shm_dir=str(other_node))) as s:
        async with DrafterClient(s.uds, namespace="far") as c:
            assert (await c.get_info()).shared_memory_supported
            assert await c.enable_shared_memory(max_step_tokens=8, dtype=torch.float32) == "inline"
            assert (await c.propose([step("f")])).sequences[0].ok and c.steps_inline == 1
            with pytest.raises(DrafterError) as e:
                await c.enable_shared_memory(max_step_tokens=8, dtype=torch.float32, kind="system")
            assert e.value.code == grpc.StatusCode.NOT_FOUND and "inline" in e.value.message
    with ServerThread(make_config(head, target, tmp_path / "b", shared_memory=False)) as s:
        async with DrafterClient(s.uds, namespace="off") as c:
            info = await c.get_info()
            assert not info.shared_memory_supported and list(info.shared_memory_kinds) == []
            assert await c.enable_shared_memory(max_step_tokens=8, dtype=torch.float32) == "inline"
            await refused(c.shared_memory_status(), grpc.StatusCode.UNIMPLEMENTED, "inline")
            r = build_request("off", [step("g")], SharedTensorRef("x", 0, torch.float32, (4, H)))
            await refused(c._stub.Propose(r), grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shm")
