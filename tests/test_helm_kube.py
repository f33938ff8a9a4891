"""Kubernetes versions per mode, and checkov on the pool render.

- Native sidecar (sidecar.native: true) needs Kubernetes 1.29: `helm template --kube-version 1.28` fails with a
  message that names the fallback (sidecar.native=false), 1.29 renders; the plain-container fallback and pool mode
  render on 1.27 (the chart's kubeVersion). The parent-chart example gets the same check through the
  .Capabilities it passes to the drafter templates.
- checkov (https://www.checkov.io) on the pool-mode default render: no failed check, and each check the chart skips
  carries its reason in a `checkov.io/skipN` annotation; with the values that fix them (image.digest, a CPU limit,
  image.pullPolicy Always, networkPolicy.enabled) nothing is skipped and nothing fails.

checkov is found as $CHECKOV, `checkov` on PATH, or ~/.cache/drafter-sidecar/checkov-venv/bin/checkov (where .ci/run
installs the pinned version, in its own virtualenv: its pins clash with the project's); without it that test skips.
(The strict Kubernetes schema validation of every mode on every version from the oldest supported to the newest
kubernetes-validate knows is tests/test_helm_chart.py::test_rendered_objects_match_kubernetes_schemas.)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_helm_chart import (ENGINE, IMAGE, by_kind, drafter_of, helm, helm_env,  # noqa: F401
                             needs_helm, parent_chart, render, render_fails, set_args, yaml)

NATIVE_MESSAGE = "sidecar.native=true needs Kubernetes 1.29 or later"


@needs_helm
def test_native_sidecar_needs_kubernetes_1_29(helm_env):
    sidecar = {"image.repository": IMAGE, "mode": "sidecar", **ENGINE}
    for version in ("1.27.0", "1.28.9"):
        stderr = render_fails(helm_env, sidecar, kube_version=version)
        assert NATIVE_MESSAGE in stderr and "sidecar.native=false" in stderr and f"v{version}" in stderr, stderr
    for version in ("1.29.0", "1.33.1"):
        (dep,) = render(helm_env, sidecar, kube_version=version)
        assert drafter_of(dep["spec"]["template"]["spec"])["restartPolicy"] == "Always"
    # the documented fallback: a plain second container, and pool mode, on the chart's oldest Kubernetes
    (dep,) = render(helm_env, {**sidecar, "sidecar.native": False}, kube_version="1.27.0")
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["engine", "drafter"]
    assert "Deployment" in by_kind(render(helm_env, kube_version="1.27.0"))
    # older than the chart's kubeVersion: helm itself refuses
    assert "kubeVersion" in render_fails(helm_env, {"image.repository": IMAGE}, kube_version="1.26.0")


@needs_helm
def test_parent_chart_example_checks_the_kubernetes_version(helm_env, tmp_path):
    work = parent_chart(helm_env, tmp_path)
    sets = set_args({"engine.image": "registry.example.com/engine:1", "drafter.image.repository": IMAGE})
    proc = helm(helm_env, "template", "e", str(work / "engine"), *sets, "--kube-version", "1.28.0", check=False)
    assert proc.returncode != 0 and NATIVE_MESSAGE in proc.stderr, proc.stderr
    proc = helm(helm_env, "template", "e", str(work / "engine"), *sets, *set_args({"drafter.sidecar.native": False}),
                "--kube-version", "1.28.0")
    (dep,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["engine", "drafter"]
    helm(helm_env, "template", "e", str(work / "engine"), *sets, "--kube-version", "1.29.0")


# ---------------------------------------------------------------------------------------------------------------
# checkov


def find_checkov() -> str | None:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "drafter-sidecar" / "checkov-venv"
    for candidate in (os.environ.get("CHECKOV"), shutil.which("checkov"), str(cache / "bin" / "checkov")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


CHECKOV = find_checkov()
# the findings the chart accepts on purpose (templates/_helpers.tpl, drafter.checkovSkips)
ACCEPTED = {"CKV_K8S_15", "CKV_K8S_43", "CKV_K8S_11", "CKV2_K8S_6"}
FIXED = {"image.digest": "sha256:" + "ab" * 32, "image.pullPolicy": "Always", "resources.limits.cpu": "4",
         "networkPolicy.enabled": True}


def checkov_results(directory: Path) -> dict[str, dict[str, list[dict]]]:
    """checkov's kubernetes checks on every file of directory: {file name: {"failed": [...], "skipped": [...]}}."""
    proc = subprocess.run([CHECKOV, "--directory", str(directory), "--framework", "kubernetes", "--output", "json",
                           "--skip-download", "--compact"],  # --skip-download: offline, no Prisma Cloud look-ups
                          capture_output=True, text=True, timeout=600, env={**os.environ, "LOG_LEVEL": "ERROR"})
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov gave no JSON report (exit {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (kube,) = [r for r in (report if isinstance(report, list) else [report]) if r["check_type"] == "kubernetes"]
    out: dict[str, dict[str, list[dict]]] = {}
    for kind in ("failed", "skipped", "passed"):
        for check in kube["results"].get(f"{kind}_checks", []):
            per_file = out.setdefault(Path(check["file_path"]).name, {"failed": [], "skipped": [], "passed": []})
            per_file[kind].append(check)
    return out


@needs_helm
@pytest.mark.skipif(CHECKOV is None, reason="checkov is not installed (set CHECKOV, put it on PATH, or "
                                            "`python -m venv ~/.cache/drafter-sidecar/checkov-venv && "
                                            "~/.cache/drafter-sidecar/checkov-venv/bin/pip install checkov`; .ci/run "
                                            "does): the pool render is not scanned")
def test_checkov_pool_default(helm_env, tmp_path):
    for name, sets in (("default.yaml", {}), ("fixed.yaml", FIXED)):
        docs = render(helm_env, sets)
        (tmp_path / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    results = checkov_results(tmp_path)

    default = results["default.yaml"]
    assert default["passed"], "checkov ran no check"
    failed = sorted({(c["check_id"], c["resource"]) for c in default["failed"]})
    assert not failed, f"checkov findings on the pool default render: {failed}"
    skipped = {c["check_id"]: c["check_result"].get("suppress_comment", "") for c in default["skipped"]}
    assert set(skipped) == ACCEPTED, skipped
    for check_id, reason in skipped.items():
        assert len(reason) > 30 and reason != "No comment provided", (check_id, reason)

    fixed = results["fixed.yaml"]
    assert not fixed["failed"], sorted({c["check_id"] for c in fixed["failed"]})
    assert not fixed["skipped"], "with the fixing values no skip annotation is left"
