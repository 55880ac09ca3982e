"""mkdocs hooks for the book's site (site/build.py names this file in the config it writes)."""

import re

HEADING_ID = re.compile(r'<h[1-6]\b[^>]*\sid="([^"]+)"')


def anchors(toc):
    for item in toc:
        yield item
        yield from anchors(item.children)


def on_page_content(html, page, config, files):
    """A notebook page's table of contents points at the ids its headings really have.

    mkdocs-jupyter slugs the contents from a Markdown copy of the notebook, where a heading's
    `code` drops out of the slug ("3. Communicators and `Split`" -> 3-communicators-and), while
    the page's heading keeps it (3-communicators-and-split). Both list the headings in order.
    """
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    ids = HEADING_ID.findall(html)
    items = list(anchors(page.toc))
    if len(items) == len(ids):
        for item, anchor in zip(items, ids):
            item.id = anchor
    return html
