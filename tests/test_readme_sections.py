"""The README's cross references lead somewhere: `section "DCGAN"` in the README, and
`README, "WGAN-GP"` in a comment or docstring of the code, each name one of the README's
headings (or a heading's start, before its colon, comma or bracket). A renamed heading fails
here, not on a reader who looks for it."""
import os
import re
from pathlib import Path

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
IN_README = re.compile(r"\bsections?\s+\"([^\"]+)\"", re.IGNORECASE)
IN_CODE = re.compile(r"\bREADME(?:\.md)?,?\s+(?:section\s+)?\"([^\"]+)\"")


def plain(text: str) -> str:
    return text.replace("`", "").strip().lower()


def headings(markdown: str) -> list[str]:
    """Its '#' lines outside the code blocks, where '# ' starts a comment."""
    found, in_block = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif not in_block and re.match(r"#{1,6} ", line):
            found.append(plain(line.lstrip("#")))
    return found


HEADINGS = headings(README)


def names_a_heading(reference: str) -> bool:
    reference = plain(reference)
    return any(heading == reference or any(heading.startswith(reference + end) for end in (":", ",", " ("))
               for heading in HEADINGS)


def one_line(text: str) -> str:
    """Text with its line breaks, and the comment signs that continue a comment, made spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def python_files():
    """The repository's own: not .venv's, nor what runs/ may hold."""
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "runs"]
        yield from (Path(folder) / name for name in files if name.endswith(".py"))


def test_the_check_knows_a_heading_from_a_stale_name():
    assert names_a_heading("DCGAN") and names_a_heading("what moved the FID")
    assert names_a_heading("Side by side") and names_a_heading("What --amp does")
    assert not names_a_heading("DCGANs") and not names_a_heading("Side")
    assert not names_a_heading("run from the repository root")  # a comment in a code block


def test_every_section_the_readme_names_is_one_of_its_headings():
    references = IN_README.findall(one_line(README))
    assert len(references) >= 20  # the pattern still finds them
    assert [name for name in references if not names_a_heading(name)] == []


def test_every_readme_section_the_code_names_is_one_of_its_headings():
    references = [(str(path.relative_to(REPO)), name) for path in python_files()
                  for name in IN_CODE.findall(one_line(path.read_text()))]
    assert len(references) >= 5
    assert [(path, name) for path, name in references if not names_a_heading(name)] == []


def github_anchor(heading_line: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but '-' and '_' dropped, spaces '-'."""
    return re.sub(r"[^\w\- ]", "", heading_line.lstrip("#").strip().lower()).replace(" ", "-")


def test_the_contents_links_lead_to_headings():
    anchors, in_block = set(), False
    for line in README.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif not in_block and re.match(r"#{1,6} ", line):
            anchors.add(github_anchor(line))
    links = re.findall(r"\]\(#([^)]+)\)", README)
    assert len(links) >= 30  # the contents list, one link per section
    assert [link for link in links if link not in anchors] == []
    assert github_anchor("### What `--amp` does") == "what---amp-does"
