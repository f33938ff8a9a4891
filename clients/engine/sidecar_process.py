"""The drafter sidecar as a child process (for the demo and benchmarks): start, wait for health SERVING, SIGTERM.

    with SidecarProcess("models/eagle1", "models/target") as sidecar:   # listens on a fresh Unix socket
        async with DrafterClient(sidecar.address) as drafter: ...

The child runs in its own session, so a Ctrl-C in the terminal reaches only the parent, which then stops the
sidecar with SIGTERM (health NOT_SERVING, in-flight steps finish, exit 0) and waits for it; SIGKILL only if it
has not exited after the grace period.
"""
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]


def _bundled_models() -> pathlib.Path:
    """Where the bundled demo models are: drafter_service/bundled_models in a wheel install (found without importing
    the server), else the checkout's models/."""
    spec = importlib.util.find_spec("drafter_service")  # (a top-level package: finding it runs none of its code)
    if spec is not None and spec.origin:
        installed = pathlib.Path(spec.origin).parent / "bundled_models"
        if installed.is_dir():
            return installed
    return REPO / "models"


MODELS = _bundled_models()


class SidecarError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a child's --metrics-port: a fixed one collides with
    another run on the same machine, and the child then exits at start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float, log_tail: Callable[[], str]) -> None:
    """Wait until the drafter process proc answers health SERVING at address; SidecarError (with log_tail()) when it
    exits first or is not SERVING within timeout_s."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            code = proc.poll()
            if code is not None:
                raise SidecarError(f"the sidecar exited with code {code} before serving; its log:\n{log_tail()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise SidecarError(f"the sidecar was not SERVING after {timeout_s:.0f} s; its log:\n{log_tail()}")
            time.sleep(0.1)


class SidecarProcess:
    def __init__(self, model: str | os.PathLike, target_model: str | os.PathLike | None = None,
                 device: str | None = None, extra_args: list[str] | None = None, ready_timeout_s: float = 120.0,
                 grace_s: float = 10.0, env: dict[str, str] | None = None):
        self.model = str(model)
        self.env = dict(os.environ, **(env or {}))  # the child's environment
        self.target_model = None if target_model is None else str(target_model)
        self.device = device
        self.extra_args = list(extra_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self._dir = tempfile.TemporaryDirectory(prefix="drafter-")
        self.address = f"unix:{self._dir.name}/drafter.sock"
        self.log_path = pathlib.Path(self._dir.name) / "drafter.log"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.terminated = False  # stop() sent SIGTERM (rather than finding the process already gone)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "drafter_service.cli", "--model", self.model, "--listen", self.address,
               "--shutdown-grace-s", str(self.grace_s)]
        if self.target_model:
            cmd += ["--target-model", self.target_model]
        if self.device:
            cmd += ["--device", self.device]
        return cmd + self.extra_args

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> "SidecarProcess":
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True, env=self.env)
        finally:
            log.close()
        try:
            self._wait_serving()
        except BaseException:  # also Ctrl-C while the model loads: never leave the child running
            self.stop()
            raise
        return self

    def _wait_serving(self) -> None:
        wait_serving(self.address, self.proc, self.ready_timeout_s, self.log_tail)

    def stop(self) -> int | None:
        """SIGTERM, wait for the graceful exit (SIGKILL after grace + 5 s); returns the exit code."""
        if self.proc is None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True
            try:
                self.proc.wait(self.grace_s + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.proc = None
        return self.exit_code

    def kill(self) -> int | None:
        """SIGKILL at once, no grace (a crash: in-flight steps get no reply); start() brings the sidecar back at the
        same address. Returns the exit code."""
        if self.proc is None:
            return self.exit_code
        self.proc.kill()
        self.proc.wait()
        self.exit_code = self.proc.returncode
        self.proc = None
        return self.exit_code

    def close(self) -> int | None:
        """stop() and remove the socket directory (with the log); returns the exit code."""
        code = self.stop()
        self._dir.cleanup()
        return code

    def __enter__(self) -> "SidecarProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
