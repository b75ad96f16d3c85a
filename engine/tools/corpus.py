"""The Python standard library's own source, as a training corpus and a source of code prompts.

Every machine with Python has it, so the sample model can be rebuilt anywhere without a
download. The file list is sorted and filtered the same way everywhere; the text itself
depends on the Python version, which the training stats record.

Files are split into train and validation by a hash of their path relative to the stdlib
root (about 2% held out), so the split does not depend on the file list or its order.
"""

from __future__ import annotations

import hashlib
import random
import re
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

# Directories that are tests, GUI demos, vendored/legacy trees or data tables rather than code.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
    "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
    "encodings",  # mostly generated codec tables
    "pydoc_data",  # one giant string of documentation
})
VALIDATION_PERCENT = 2
SPLITS = ("train", "val", "all")

_DEF_LINE = re.compile(r"^([ \t]*)(?:async[ \t]+def|def|class)[ \t]+\w")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    # config-3.x-<platform>/ and _sysconfigdata_*.py describe this build, not portable code
    return (any(d in SKIP_DIRS or d.startswith("config-") for d in dirs)
            or rel.name.startswith("_sysconfigdata"))


def is_validation(rel_path: str | Path) -> bool:
    """Held-out files: a fixed ~2% chosen by a hash of the path relative to the stdlib root."""
    digest = hashlib.sha256(Path(rel_path).as_posix().encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < VALIDATION_PERCENT


def stdlib_files(split: str = "all", root: str | Path | None = None) -> list[Path]:
    """The corpus files of one split ("train", "val" or "all"), sorted by relative path."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {SPLITS}")
    return list(_files(split, str(root or stdlib_root())))


@lru_cache(maxsize=8)
def _files(split: str, root: str) -> tuple[Path, ...]:
    base = Path(root)
    rels = sorted((p.relative_to(base) for p in base.rglob("*.py") if p.is_file()),
                  key=lambda r: r.as_posix())
    rels = [r for r in rels if not _skipped(r)]
    if split != "all":
        rels = [r for r in rels if is_validation(r) == (split == "val")]
    return tuple(base / r for r in rels)


def read_source(path: Path) -> str | None:
    """A file's text with newlines normalised, or None if it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8").replace("\r\n", "\n")
    except (OSError, UnicodeDecodeError):
        return None


def iter_source_text(split: str = "train", root: str | Path | None = None,
                     max_chars: int | None = None) -> Iterator[str]:
    """One string per file, in file order; stops after about max_chars characters."""
    total = 0
    for path in stdlib_files(split, root):
        text = read_source(path)
        if not text:
            continue
        yield text
        total += len(text)
        if max_chars is not None and total >= max_chars:
            return


def corpus_summary(split: str = "all", root: str | Path | None = None) -> dict:
    """File count, characters and a fingerprint of the file list, for provenance records."""
    base = Path(root or stdlib_root())
    files = stdlib_files(split, base)
    names = "\n".join(p.relative_to(base).as_posix() for p in files)
    return {"split": split, "files": len(files),
            "chars": sum(len(t) for t in iter_source_text(split, base)),
            "file_list_sha256": hashlib.sha256(names.encode()).hexdigest()[:16]}


def code_snippets(n: int, seed: int = 0, min_chars: int = 64, max_chars: int = 400,
                  split: str = "all", root: str | Path | None = None) -> list[str]:
    """n short code prompts, each a `def`/`class` header and the start of its body, dedented.

    Deterministic for (n, seed, bounds, split, Python version). Snippets end on a line
    boundary, within [min_chars, max_chars]. Distinct sources are used while they last;
    beyond that the list repeats.
    """
    pool = _snippet_pool(split, str(root or stdlib_root()), min_chars, max_chars)
    if not pool:
        raise ValueError("code_snippets: no snippet fits the requested length bounds")
    rng = random.Random(seed)
    picks: list[str] = []
    while len(picks) < n:
        picks += rng.sample(pool, min(len(pool), n - len(picks)))
    return picks


@lru_cache(maxsize=8)
def _snippet_pool(split: str, root: str, min_chars: int, max_chars: int) -> tuple[str, ...]:
    pool = []
    for text in iter_source_text(split, root):
        lines = text.split("\n")
        for i, line in enumerate(lines):
            match = _DEF_LINE.match(line)
            if match:
                snippet = _block_prefix(lines, i, match.group(1), max_chars)
                if len(snippet) >= min_chars:
                    pool.append(snippet)
    return tuple(pool)


def _block_prefix(lines: list[str], start: int, indent: str, max_chars: int) -> str:
    """The def/class at lines[start] and its body, dedented, cut at a line boundary."""
    out, size = [], 0
    for j in range(start, len(lines)):
        line = lines[j]
        closes_bracket = line.lstrip().startswith((")", "]", "}"))  # e.g. the "):" ending a signature
        if j > start and line.strip() and not _deeper(line, indent) and not closes_bracket:
            break  # back at the def's own indentation: its block is over
        piece = line[len(indent):] if line.startswith(indent) else line.lstrip()
        if size + len(piece) + 1 > max_chars:
            break
        out.append(piece)
        size += len(piece) + 1
    return "\n".join(out).rstrip() + "\n"


def _deeper(line: str, indent: str) -> bool:
    return line.startswith(indent) and line[len(indent):len(indent) + 1] in (" ", "\t")
