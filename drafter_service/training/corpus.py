"""Corpus: the Python standard library sources of the running interpreter, split into train and held-out files.

Files: every ``*.py`` under ``sysconfig.get_paths()['stdlib']``, in sorted relative-path order, skipping
site-packages/dist-packages and test directories. A file is held out when ``sha1(relpath) % 20 == 0``
(deterministic, independent of the seed and of which other files exist).
"""
import hashlib
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HELDOUT_MODULUS = 20


@dataclass
class Corpus:
    root: str
    python_version: str
    train_paths: list[str] = field(default_factory=list)
    heldout_paths: list[str] = field(default_factory=list)
    train_texts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    total_files: int = 0  # eligible files before any byte cap

    def stats(self) -> dict:
        return {
            "source": "python stdlib *.py (tests and site-packages excluded)",
            "root": self.root,
            "python_version": self.python_version,
            "eligible_files": self.total_files,
            "train_files": len(self.train_paths),
            "heldout_files": len(self.heldout_paths),
            "train_bytes": sum(len(t.encode()) for t in self.train_texts),
            "heldout_bytes": sum(len(t.encode()) for t in self.heldout_texts),
            "heldout_rule": f"sha1(relpath) % {HELDOUT_MODULUS} == 0",
        }


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the eligible stdlib sources, sorted."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a handful of stdlib files are latin-1 test fixtures; skip rather than guess


def load_corpus(max_train_bytes: int | None = None, root: str | None = None) -> Corpus:
    """Read the stdlib corpus. ``max_train_bytes`` caps the train split (held-out: 1/19 of it, at least 20 kB):
    files are taken in sorted order, skipping any that would overflow the cap."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    if not root_path.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root_path}")
    files = stdlib_files(root_path)
    if not files:
        raise RuntimeError(f"no *.py files under {root_path}")
    corpus = Corpus(root=str(root_path), python_version=sys.version.split()[0], total_files=len(files))
    train_bytes = heldout_bytes = 0
    heldout_cap = None if max_train_bytes is None else max(max_train_bytes // (HELDOUT_MODULUS - 1), 20_000)
    for rel in files:
        text = _read(root_path / rel)
        if not text or not text.strip():
            continue
        size = len(text.encode())
        if is_heldout(rel):
            if heldout_cap is not None and heldout_bytes + size > heldout_cap:
                continue
            corpus.heldout_paths.append(rel)
            corpus.heldout_texts.append(text)
            heldout_bytes += size
        else:
            if max_train_bytes is not None and train_bytes + size > max_train_bytes:
                continue
            corpus.train_paths.append(rel)
            corpus.train_texts.append(text)
            train_bytes += size
    if not corpus.train_texts or not corpus.heldout_texts:
        raise RuntimeError(f"corpus split is empty (train={len(corpus.train_texts)}, heldout={len(corpus.heldout_texts)})")
    return corpus
