import asyncio
import os
import pathlib
import threading

import torch

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. This must be set before anything imports
# triton (any test module may import drafter_kernels first), so it is set here, once, for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests check drafts, not timing: a client built without a step deadline gets a generous one (a first CUDA step that
# compiles kernels, or a loaded CI machine, must not turn a step into a "no drafts" fallback). The tests of the
# deadline itself (tests/test_client_fallback.py, scripts/soak.py) pass theirs explicitly.
os.environ.setdefault("DRAFTER_STEP_TIMEOUT_S", "120")

import pytest  # noqa: E402

from checkpoints import write_eagle1  # noqa: E402
from drafter_service.config import ServerConfig  # noqa: E402
from drafter_service.server import DrafterServer  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class ServerThread:
    """A DrafterServer on its own event loop in a background thread (tests keep their own loops)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server = DrafterServer(config)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(120)
        return self

    def call(self, fn, *args):
        """Run fn on the step thread (e.g. to read the sequence table) and return its result."""
        return asyncio.run_coroutine_threadsafe(self.server.scheduler.run_exclusive(fn, *args), self.loop).result(30)

    @property
    def tcp(self) -> str:
        return next(a for a in self.server.bound_addresses if not a.startswith("unix:"))

    @property
    def uds(self) -> str:
        return next(a for a in self.server.bound_addresses if a.startswith("unix:"))

    def stop(self, grace_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop).result(60)

    def __exit__(self, *exc) -> None:
        if self.server.server is not None:
            try:
                self.stop(1.0)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(head_dir, target_dir) of a tiny EAGLE-1 head with fc.bias and a target holding embed/lm_head."""
    return write_eagle1(tmp_path_factory.mktemp("tiny"), seed=0, fc_bias=True)


def make_config(head, target, tmp_path, **kw) -> ServerConfig:
    sock = pathlib.Path(tmp_path) / "drafter.sock"
    args = dict(model=str(head), target_model=str(target), listen=["127.0.0.1:0", f"unix:{sock}"], device="cpu",
                reflection=True,  # (off by default; the lifecycle test lists services by reflection)
                dtype="float32", kv_cache_tokens=16384, max_draft_tokens=8)
    args.update(kw)
    return ServerConfig(**args)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path_factory.mktemp("srv"))) as s:
        yield s
