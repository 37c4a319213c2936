"""Docstrings: every example in the package runs and shows what it says (doctest); papers, not trackers."""

import doctest
import importlib
import pkgutil

import pytest

import treespec_sglang

MODULES = sorted(m.name for m in pkgutil.walk_packages(treespec_sglang.__path__, "treespec_sglang.")
                 if not m.name.endswith("__main__"))  # running it would start the CLI
NEEDS_CUDA = {"treespec_sglang.attention.flashinfer_backend"}  # imports flashinfer, a CUDA-only package


@pytest.mark.parametrize("name", [m for m in MODULES if m not in NEEDS_CUDA])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_code_cites_papers_not_tracker_numbers():
    """A reader of the code has no tracker and no workplace folder: no 'issue 13' and no ``shared/notes`` path in
    the package, the benches or CI's dependency list."""
    import pathlib
    import re

    root = pathlib.Path(treespec_sglang.__file__).parent
    files = list(root.rglob("*.py")) + list((root.parent / "bench").glob("*.py"))
    hits = [f"{f.name}:{i + 1}" for f in files for i, line in enumerate(f.read_text().splitlines())
            if re.search(r"\bissue\s*#?\d+", line, re.IGNORECASE)]
    assert not hits, hits
    outside = [f"{f.name}:{i + 1}" for f in files + [root.parent / ".ci" / "sglang-cpu.txt"]
               for i, line in enumerate(f.read_text().splitlines())
               if re.search(r"(\.\./)?shared/(notes|gpu_sglang|papers)", line)]
    assert not outside, outside  # a reader has the repository, not the workplace's shared folder


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
# what a cited repository path starts with; bench/results/ is where the benches write (ignored by git): its
# paths are outputs a command creates, so they must be ignored, not present
PATH_PREFIXES = ("treespec_sglang/", "tests/", "bench/", "docs/", "docker/", "patches/", ".ci/")
OUTPUT_PREFIXES = ("bench/results/",)
PLACEHOLDER = ("*", "<", ">", "{", "}", "$", "...", "[", "]")


def _doc_files():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "measured" / "README.md"]


def _code_words(text):
    """Every word of every code span: fenced blocks first, then inline `...` spans of what is left."""
    import re

    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    spans = fenced + re.findall(r"`([^`]+)`", rest)  # a span may wrap onto the next line
    for span in spans:
        yield from (w for w in re.split(r"[\s,;|=\"'()]+", span) if w)


def _strip_suffix(word):
    """`tests/x.py::test_y`, `bench/x.py:12`, a trailing `(...)` or full stop -> the path alone."""
    import re

    word = word.split("::")[0]
    word = re.sub(r":\d+(-\d+)?$", "", word)
    word = re.sub(r"\(.*$", "", word)
    return word.rstrip(".:")


def _slug(heading):
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces -> hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    import re

    return {_slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)}


def test_every_path_the_docs_cite_exists():
    """Every repository path the README, docs/*.md and bench/measured/README.md cite exists, and none points outside.

    Checked: every word of a code span (inline or fenced) that starts with a repository folder (PATH_PREFIXES),
    after dropping a `:line`, `::test` or `(...)` suffix; words with a glob or placeholder (`*`, `<...>`, `{4,8}`,
    `$VAR`, `...`) are skipped. Paths under bench/results/ are what the benches write: they must be ignored by git
    instead. Every relative markdown link `[text](path#anchor)`, resolved from the citing file's folder, must exist
    inside the repository, and its anchor must be a heading of the target. In bench/measured/README.md, words like
    `cpu-amx/demo_bs1.txt` (a folder and a name, no repository prefix) are checked relative to bench/measured/;
    bare file names there (`demo_bs8.txt` next to its folder) are not checked, since their folder is only implied
    by the sentence around them. No doc may name `../shared` or an absolute /work path.
    """
    import re

    gitignore = (REPO / ".gitignore").read_text().splitlines()
    measured = REPO / "bench" / "measured"
    missing, outside = [], []
    for doc in _doc_files():
        text = doc.read_text()
        where = doc.relative_to(REPO)
        if "../shared" in text or "/work/" in text:
            outside.append(f"{where}: names ../shared or /work/")
        for word in _code_words(text):
            if any(p in word for p in PLACEHOLDER):
                continue
            path = _strip_suffix(word)
            if path.startswith(OUTPUT_PREFIXES):
                if not any(line.strip().rstrip("/") == path.split("/")[0] + "/" + path.split("/")[1]
                           for line in gitignore):
                    missing.append(f"{where}: {word} (an output path, but not ignored by git)")
            elif path.startswith(PATH_PREFIXES):
                if not (REPO / path).exists():
                    missing.append(f"{where}: {word}")
            elif doc.parent == measured and re.fullmatch(r"[\w.-]+/[\w./-]*", path) and "//" not in path:
                if not (measured / path).exists():
                    missing.append(f"{where}: {word} (relative to bench/measured/)")
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if REPO not in dest.parents and dest != REPO:
                outside.append(f"{where}: link {target} leaves the repository")
            elif not dest.exists():
                missing.append(f"{where}: link {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                missing.append(f"{where}: link {target} (no such heading)")
    assert not outside, outside
    assert not missing, missing


def test_docs_cite_no_tracker_numbers():
    """A reader of the docs has no tracker either: no 'issue 10' in the README or docs/."""
    import re

    hits = [f"{doc.relative_to(REPO)}:{i + 1}" for doc in _doc_files()
            for i, line in enumerate(doc.read_text().splitlines())
            if re.search(r"\bissue\s*#?\d+", line, re.IGNORECASE)]
    assert not hits, hits
