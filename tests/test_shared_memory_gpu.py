"""CUDA IPC between two processes (needs a GPU: skipped on CPU machines; run it on an H100/H200).

CUDA IPC cannot be tested inside one process (a process cannot open its own handle), so the engine side always
runs in a child process started with a fresh interpreter (its own CUDA context, as a real engine has):
  - the driver round trip: the child cuMemAlloc's and fills a buffer, the test opens its handle and reads it;
  - end to end: the drafter runs in this process on the GPU; the child drives four clients with the same steps,
    hidden states on its GPU, sent through a CUDA IPC ring (one device-to-device copy on each side), through
    pinned host shared memory (device-to-host into the ring, host-to-device on the drafter), inline, and through
    the engine's own GPU buffer registered as a region. All four must draft the same tokens, equal to the naive
    reference. With two GPUs the engine also runs on the
    other one (a peer copy on the drafter's side).
"""
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ServerThread, make_config

pytestmark = pytest.mark.gpu

TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)

EXPORTER = textwrap.dedent("""
    import sys, torch
    from drafter_client.protocol import cuda_driver
    n = 1 << 20
    ptr = cuda_driver.mem_alloc(0, n)
    buf = cuda_driver.device_bytes(ptr, n, 0)
    buf.copy_((torch.arange(n, device="cuda:0") % 251).to(torch.uint8))
    torch.cuda.synchronize()
    print(cuda_driver.ipc_get_handle(0, ptr).hex(), flush=True)
    sys.stdin.readline()  # keep the allocation alive until the reader is done
    del buf
    cuda_driver.mem_free(0, ptr)
""")


def test_cuda_driver_ipc_roundtrip_between_processes():
    from drafter_client.protocol import cuda_driver

    child = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        handle = bytes.fromhex(child.stdout.readline().strip())
        assert len(handle) == 64
        torch.cuda.init()
        ptr, available, ordinal = cuda_driver.ipc_open(0, handle)
        assert available >= 1 << 20 and ordinal == 0
        seen = cuda_driver.device_bytes(ptr, 1 << 20, ordinal).clone()
        cuda_driver.ipc_close(0, ptr)
        assert torch.equal(seen.cpu(), (torch.arange(1 << 20) % 251).to(torch.uint8))
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        child.kill()


ENGINE = textwrap.dedent("""
    import asyncio, json, random, sys, torch
    target, head, target_dir, device, tests_dir = sys.argv[1:6]
    sys.path.insert(0, tests_dir)
    from drafter_client import DrafterClient, SharedTensorRef
    from fake_engine import FakeSequence
    from naive_eagle import NaiveEagle1

    async def main():
        naive = NaiveEagle1(head, target_dir)
        rng, dev = random.Random(5), torch.device(device)
        out = {"path_mismatches": [], "naive_mismatches": [], "errors": []}
        async with DrafterClient(target, namespace="gpu-ipc") as ipc, \\
                DrafterClient(target, namespace="gpu-host") as host, \\
                DrafterClient(target, namespace="gpu-inline") as inline, \
                DrafterClient(target, namespace="gpu-own") as own:
            out["planes"] = [
                await ipc.enable_shared_memory(256, dtype=torch.float32, kind="cuda", device=dev),
                await host.enable_shared_memory(256, dtype=torch.float32, kind="system", device=dev)]
            # the engine's own GPU buffer, registered as a region (torch's caching allocator, no ring)
            buffer = torch.empty(256, naive.H, device=dev)
            await own.register_cuda_tensor("engine-buffer", buffer)
            seqs = [FakeSequence(f"s{i}", p, naive.H, naive.lm_head.shape[0], rng, c)
                    for i, (p, c) in enumerate([(40, None), (95, 16), (7, None)])]
            for n in range(20):
                steps = [s.next_step(rng.randint(1, 6)) for s in seqs]
                for st in steps:
                    st.hidden_states = st.hidden_states.to(dev)
                results = [await c.propose(steps) for c in (ipc, host, inline)]
                rows = sum(st.hidden_states.shape[0] for st in steps)
                torch.cat([st.hidden_states for st in steps], out=buffer[:rows])
                torch.cuda.synchronize(dev)  # a region of its own: the engine makes the data ready itself
                results.append(await own.propose(steps, SharedTensorRef("engine-buffer", 0, torch.float32,
                                                                        (rows, naive.H))))
                for i, (s, st) in enumerate(zip(seqs, steps)):
                    got = [r.sequences[i] for r in results]
                    if not all(g.ok for g in got):
                        out["errors"].append([g.message for g in got])
                        continue
                    drafts = [g.drafts.tolist() for g in got]
                    if not drafts[0] == drafts[1] == drafts[2] == drafts[3]:
                        out["path_mismatches"].append([n, s.seq_id, drafts])
                    if st.num_drafts:
                        expected = naive.drafts(s.tokens, s.hidden, st.num_drafts)
                        if drafts[0] != expected:
                            out["naive_mismatches"].append([n, s.seq_id, drafts[0], expected])
                        s.last_drafts = drafts[2]
            out["regions"] = [[r.kind, r.device, r.pinned, r.references_read]
                              for c in (ipc, host, own) for r in await c.shared_memory_status()]
            out["by_reference"] = [c.steps_by_reference for c in (ipc, host, inline, own)]
        print(json.dumps(out), flush=True)

    asyncio.run(main())
""")


@pytest.mark.parametrize("engine_device", ["cuda:0", "cuda:1"])
def test_cuda_ipc_and_pinned_host_drafts_match_inline_between_processes(tiny_model, tmp_path, engine_device):
    if torch.device(engine_device).index >= torch.cuda.device_count():
        pytest.skip(f"{engine_device}: a peer GPU is needed")
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, device="cuda:0", dtype="float32")) as s:
        proc = subprocess.run([sys.executable, "-c", ENGINE, s.uds, str(head), str(target), engine_device, TESTS_DIR],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert s.server.servicer.regions.regions == {}  # the clients unregistered on close
    assert out["planes"] == ["cuda", "system"]
    assert out["by_reference"] == [20, 20, 0, 20]
    assert out["errors"] == []
    assert out["path_mismatches"] == [], "CUDA IPC ring / pinned host / inline / own buffer gave different drafts"
    assert out["naive_mismatches"] == [], "the CUDA server's drafts differ from the naive reference"
    ((ipc_kind, ipc_device, _, ipc_reads), (host_kind, host_device, host_pinned, host_reads),
     (own_kind, own_device, _, own_reads)) = out["regions"]
    # CUDA_IPC, addressed from the drafter's GPU (cuda:0) also when the memory is a peer GPU's (cuda_driver.ipc_open)
    assert ipc_kind == 2 and ipc_device == "cuda:0" and ipc_reads == 20
    assert own_kind == 2 and own_device == "cuda:0" and own_reads == 20
    assert host_kind == 1 and host_device == "cpu" and host_reads == 20  # SYSTEM
    assert host_pinned, "cuMemHostRegister(READ_ONLY) refused the read-only mapping: host-to-device copies are pageable"
