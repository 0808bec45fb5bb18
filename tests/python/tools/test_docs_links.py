"""Every relative link in README.md and docs/ resolves: the file (or folder) it names exists, and
an anchor names a heading of that file, as GitHub derives them. Documentation moves (the
benchmark journal, results, the Python guide and reference) are where such links break."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

_FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target), the target up to whitespace or ')' (an optional "title"
# after it); [label]: target reference definitions.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _prose_lines(text, keep_code_spans=False):
    """The lines outside fenced code blocks, code spans blanked unless asked (a link there is not
    a link; a heading's anchor keeps their text)."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line if keep_code_spans else _CODE_SPAN.sub("", line)


def slug(heading):
    """GitHub's anchor for a heading's text: lower case, inline markup and punctuation dropped
    (letters, digits, '_', '-' and spaces kept), spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen = {}
    result = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), keep_code_spans=True):
        m = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def links(path):
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in _INLINE.finditer(line):
            yield number, m.group(1)
        m = _REFDEF.match(line)
        if m:
            yield number, m.group(1)


def broken_links(path):
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
        if not dest.exists():
            problems.append(f"{where}: {target}: no such file")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: {target}: no heading '{anchor}' in {dest.name}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "other.md").write_text(
        "# A heading: with `code`, punctuation\n\n## Twice\n## Twice\n")
    (tmp_path / "page.md").write_text(
        "# Page\n"
        "[fine](other.md#a-heading-with-code-punctuation) [second](other.md#twice-1) "
        "[self](#page) ![img](other.md) [web](https://example.com/x.md)\n"
        "`[in code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad self](#nowhere)\n"
        "[ref]: also-missing.md\n")
    problems = broken_links(tmp_path / "page.md")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file",
        "other.md#nope: no heading 'nope' in other.md",
        "#nowhere: no heading 'nowhere' in page.md",
        "also-missing.md: no such file",
    ]
