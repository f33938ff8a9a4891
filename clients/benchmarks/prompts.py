'''Prompts for the reference engine's demo, acceptance benchmark and acceptance-floor test.

HELDOUT_LIKE: stdlib-style Python written for this file (not taken from the standard library the demo models were
trained on), each cut where a continuation is natural. DEMO: the short prompts of ``drafter-demo``.
``stdlib_heldout_prefixes`` reads real held-out files (the training split's rule, ``sha1(relpath) % 20 == 0``)
of the running interpreter's standard library.
'''
import sysconfig
from pathlib import Path

DEMO = [
    "def fibonacci(n):",
    "class Stack:",
    "import os\n\ndef list_files(",
]

HELDOUT_LIKE = [
    '''import os
import sys


def find_executable(name, path=None):
    """Return the full path of the program *name* on the search path, or None."""
    if path is None:
        path = os.environ.get("PATH", os.defpath)
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
''',
    '''class OrderedSet:
    """A set that remembers the order in which items were added."""

    def __init__(self, iterable=None):
        self._items = {}
        if iterable is not None:
            for item in iterable:
                self.add(item)

    def add(self, item):
        self._items[item] = None

    def discard(self, item):
''',
    '''def parse_header(line):
    """Parse a Content-type like header.

    Return the main content-type and a dictionary of options.
    """
    parts = line.split(';')
    key = parts.pop(0).strip().lower()
    pdict = {}
    for p in parts:
        i = p.find('=')
        if i >= 0:
            name = p[:i].strip().lower()
''',
    '''import threading


class Counter:
    """A thread-safe counter."""

    def __init__(self, value=0):
        self._value = value
        self._lock = threading.Lock()

    def increment(self, amount=1):
        with self._lock:
''',
    '''def _read_config(filename, encoding="utf-8"):
    """Read a simple key = value configuration file into a dictionary."""
    result = {}
    with open(filename, encoding=encoding) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError("%s:%d: missing '='" % (filename, lineno))
''',
    '''class Error(Exception):
    """Base class for exceptions in this module."""
    pass


class InvalidStateError(Error):
    """Raised when an operation is attempted in the wrong state."""

    def __init__(self, state, message=None):
        if message is None:
''',
    '''def chunks(iterable, size):
    """Yield successive lists of *size* items from *iterable*.

    The last list may be shorter.
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    chunk = []
    for item in iterable:
''',
    '''    def __repr__(self):
        return '%s(%r)' % (self.__class__.__name__, self._items)

    def __len__(self):
        return len(self._items)

    def __contains__(self, key):
''',
]


def stdlib_heldout_prefixes(count: int, prefix_chars: int = 600,
                            root: str | None = None) -> tuple[list[str], list[str]]:
    """Up to ``count`` prefixes of held-out stdlib files (the training split's rule), one per file in sorted path
    order: about ``prefix_chars`` characters from the first line start after a third of the file, cut at a line
    end. Returns (prefixes, relative paths)."""
    from drafter_service.training.corpus import is_heldout, stdlib_files

    base = Path(root or sysconfig.get_paths()["stdlib"])
    texts, paths = [], []
    for rel in stdlib_files(base):
        if not is_heldout(rel):
            continue
        try:
            text = (base / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 3 * prefix_chars:
            continue
        start = text.index("\n", len(text) // 3) + 1
        cut = text.rfind("\n", start, start + prefix_chars)
        if cut <= start:
            continue
        texts.append(text[start : cut + 1])
        paths.append(rel)
        if len(texts) == count:
            break
    return texts, paths
