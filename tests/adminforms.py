"""What a browser would submit from an admin page's POST form (the test client's view)."""

from __future__ import annotations

from html.parser import HTMLParser


class _FormFields(HTMLParser):
    """The (name, value) pairs of the hidden and text inputs of the page's POST form."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: list[tuple[str, str]] = []
        self._in_form = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "form" and (named.get("method") or "").lower() == "post":
            self._in_form = True
        elif (
            tag == "input"
            and self._in_form
            and named.get("name")
            and named.get("type", "text") in ("hidden", "text")
        ):
            self.fields.append((named["name"] or "", named.get("value") or ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._in_form = False


def confirmation_form(response) -> dict[str, list[str]]:
    """The page's form, as the dict of lists the test client posts."""
    parser = _FormFields()
    parser.feed(response.content.decode())
    data: dict[str, list[str]] = {}
    for name, value in parser.fields:
        data.setdefault(name, []).append(value)
    return data
