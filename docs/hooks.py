"""mkdocs hook: docs/benchmarks.md shows the repository's BENCHMARKS.md.

BENCHMARKS.md links its plots from the repository root (``docs/img/NAME.png``, which GitHub
renders); on the site the page lives inside docs/, where the same files are ``img/NAME.png``.
The include is done here, rewriting those links, instead of by the snippets extension (which
would leave them pointing at docs/docs/img/ and fail the strict build).
"""
from pathlib import Path

INCLUDE = '--8<-- "BENCHMARKS.md"'


def on_page_markdown(markdown, page, config, files):
    if INCLUDE not in markdown:
        return markdown
    text = (Path(config.config_file_path).parent / "BENCHMARKS.md").read_text()
    return markdown.replace(INCLUDE, text.replace("](docs/img/", "](img/"))
