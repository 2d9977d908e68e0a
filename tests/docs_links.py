"""Check every link of a built documentation site: each relative ``href``/``src`` names a file of the site, and
each ``#fragment`` an ``id`` on the page it points to. External links are not followed (no network), and the
root ``404.html`` is skipped (a server returns it for any missing URL, so its links start at the root).

    python tests/docs_links.py site/
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif (tag, name) in {("a", "href"), ("link", "href"), ("img", "src"), ("script", "src")}:
                self.links.append(value)


def _parse(path: Path, cache: dict[Path, _Page]) -> _Page:
    if path not in cache:
        page = _Page()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        cache[path] = page
    return cache[path]


def broken_links(site: Path) -> list[str]:
    """``page: link (reason)`` for every link of ``site`` that leads nowhere."""
    cache: dict[Path, _Page] = {}
    problems = []
    for page_path in sorted(site.rglob("*.html")):
        if page_path.name == "404.html" and page_path.parent == site:
            continue  # served for any missing URL, so its links are absolute from the server's root
        for link in _parse(page_path, cache).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = page_path if not parts.path else (page_path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{page_path.relative_to(site)}: {link}"
            if not target.is_file():
                problems.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _parse(target, cache).ids:
                problems.append(f"{where} (no anchor #{parts.fragment})")
    return problems


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    found = broken_links(folder)
    for problem in found:
        print(problem)
    print(f"{len(found)} broken link(s) in {folder}")
    sys.exit(1 if found else 0)
