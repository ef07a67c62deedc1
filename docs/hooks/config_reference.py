"""mkdocs hook: the "Configuration" page (reference/config.md) generated from the schema at build time
(`searchrl.app.config_reference`), so that it never drifts from the code."""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri == "reference/config.md":
        from searchrl.app.config_reference import markdown as reference

        return reference()
    return markdown
