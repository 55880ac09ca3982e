"""mkdocs hooks for the book's site (site/build.py names this file in the config it writes)."""

import posixpath
import re
import urllib.parse

HEADING_ID = re.compile(r'<h[1-6]\b[^>]*\sid="([^"]+)"')
# a link or image of a notebook's Markdown: (<a ... href="), the path, its #fragment
LINKED = re.compile(r'(<(?:a|img)\b[^>]*?\s(?:href|src)=")([^"#?]+)((?:#[^"]*)?)"')
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def anchors(toc):
    for item in toc:
        yield item
        yield from anchors(item.children)


def relink(html, page, files):
    """A notebook's links, written relative to the .ipynb (../chapters/05_x.md#3-the-bubble,
    ../minidist/parallel/zero.py, as Jupyter and GitHub read them), pointed at the site's pages
    and files: mkdocs rewrites the links of Markdown pages only."""
    folder = posixpath.dirname(page.file.src_uri)

    def to_site(match):
        start, target, fragment = match.groups()
        if SCHEME.match(target) or target.startswith("/"):
            return match.group(0)
        file = files.get_file_from_path(
            posixpath.normpath(posixpath.join(folder, urllib.parse.unquote(target))))
        if file is None:
            return match.group(0)
        return f'{start}{file.url_relative_to(page.file)}{fragment}"'

    return LINKED.sub(to_site, html)


def on_page_content(html, page, config, files):
    """A notebook page's links lead where they lead from the .ipynb; its table of contents points
    at the ids its headings really have.

    mkdocs-jupyter slugs the contents from a Markdown copy of the notebook, where a heading's
    `code` drops out of the slug ("3. Communicators and `Split`" -> 3-communicators-and), while
    the page's heading keeps it (3-communicators-and-split). Both list the headings in order.
    """
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    html = relink(html, page, files)
    ids = HEADING_ID.findall(html)
    items = list(anchors(page.toc))
    if len(items) == len(ids):
        for item, anchor in zip(items, ids):
            item.id = anchor
    return html
