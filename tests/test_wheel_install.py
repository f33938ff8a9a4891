"""Starts as shipped: the wheel, installed (not editable) in a fresh environment outside the checkout, serves the
bundled EAGLE-1 head and its target with no model flags, answers health SERVING and /metrics, and exits 0 on
SIGTERM; and nothing it runs comes from the checkout.

The fresh environment is a venv without pip whose dependencies are the test venv's site-packages, seen through a
folder of links that leaves out this project's own files (the editable install's finder and metadata); pip runs
from that venv, so the console scripts point at its interpreter.
"""
import importlib.util
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile

import pytest
from prometheus_client.parser import text_string_to_metric_families

from drafter_client.engine.sidecar_process import wait_serving
from drafter_service import __version__

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "drafter_service", "kernels", "clients", "models")
OWN = ("drafter_", "__editable__", "_drafter")  # this project's entries in a site-packages folder

pytestmark = pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                                reason="setuptools is not installed in this venv (pip wheel --no-build-isolation)")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(ROOT)
    # build from a copy of the sources: an in-tree build writes build/ and *.egg-info into the checkout
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", "."],
        cwd=src)
    (wheel,) = (tmp / "dist").glob("drafter_sidecar-*.whl")
    # the fresh venv: the dependencies through links to the test venv's site-packages, minus this project
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = pathlib.Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = tmp / "deps"
    deps.mkdir()
    folders = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    # (and the PYTHONPATH folders outside the checkout: where a machine without a venv keeps extra wheels)
    folders += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and pathlib.Path(p).is_dir() and not pathlib.Path(p).resolve().is_relative_to(ROOT)]
    for folder in dict.fromkeys(folders):
        for entry in pathlib.Path(folder).iterdir():
            if not entry.name.startswith(OWN) and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (site / "drafter-test-deps.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp, env=env)
    return {"tmp": tmp, "wheel": wheel, "python": python, "site": site, "env": env,
            "serve": venv / "bin" / "drafter-serve"}


def test_the_wheel_holds_the_bundled_models_and_the_dependency(installed):
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for model in ("eagle1", "eagle3", "target"):
        assert f"drafter_service/bundled_models/{model}/config.json" in names
        assert f"drafter_service/bundled_models/{model}/model.safetensors" in names
    assert "drafter_service/bundled_models/target/tokenizer.json" in names
    assert not any("training_" in n for n in names)
    assert "Requires-Dist: prometheus_client" in meta


def test_the_installed_package_does_not_come_from_the_checkout(installed):
    code = ("import sys, drafter_service, drafter_client, drafter_kernels, drafter_service.cli as cli\n"
            "print(drafter_service.__file__); print(drafter_client.__file__); print(drafter_kernels.__file__)\n"
            "print(cli.BUNDLED_MODEL); print(cli.parse_args([]).target_model)\n"
            "print('\\n'.join(sys.path))")
    out = run([installed["python"], "-c", code], cwd=installed["tmp"], env=installed["env"]).stdout.splitlines()
    site = str(installed["site"])
    for line in out[:5]:
        assert line.startswith(site), f"{line} is not in the installed site-packages {site}"
    assert out[3].endswith("bundled_models/eagle1") and out[4].endswith("bundled_models/target")
    assert not [p for p in out[5:] if p and pathlib.Path(p).resolve().is_relative_to(ROOT)], out[5:]


def test_drafter_serve_starts_with_no_model_flags_and_stops_on_sigterm(installed):
    sock = installed["tmp"] / "drafter.sock"
    port = free_port()
    log = installed["tmp"] / "serve.log"
    assert installed["serve"].read_text().startswith(f"#!{installed['python']}")
    with open(log, "wb") as out:
        proc = subprocess.Popen([installed["serve"], "--listen", f"unix:{sock}", "--device", "cpu",
                                 "--metrics-port", str(port)], cwd=installed["tmp"], env=installed["env"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_serving(f"unix:{sock}", proc, 300, lambda: log.read_text()[-3000:])  # (SidecarError otherwise)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "drafter_build_info"]
        assert info.labels == {"version": __version__, "method": "eagle", "device": "cpu", "dtype": "float32"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
