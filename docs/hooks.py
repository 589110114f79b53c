"""MkDocs hooks of the sgpu_magic site (mkdocs.yml, ``hooks:``).

``docs/reference/magics.md`` holds the marker ``<!-- sgpu_magic:magic-help -->``; at build time it is replaced by
each magic's ``?`` help, read from the magics' own docstrings (which ``@magic_arguments`` and ``magic_help`` turn
into the help IPython shows), and by the ``%config DistributedMagics`` options with their help (traitlets'). So
the page is the help that ships, never a copy of it. A magic that cannot be read fails the build.

The docstrings use Sphinx roles (``:func:`~sgpu_magic.distributed```), which mkdocstrings' Google-style parser
leaves as text; :func:`on_page_content` shows them as plain code, ``~`` shortening the name to its last part, as
Sphinx does.
"""

from __future__ import annotations

import html
import re

MARKER = "<!-- sgpu_magic:magic-help -->"
ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")


def _block(text: str) -> str:
    return "```text\n" + text.rstrip("\n") + "\n```\n"


def _magic_help_markdown() -> str:
    from sgpu_magic.front.magic_help import MAGICS
    from sgpu_magic.front.magics import DistributedMagics
    from sgpu_magic.front.session_magics import SessionMagics

    classes = {name: cls for cls in (DistributedMagics, SessionMagics) for name in cls.magics["line"]}
    classes.update(dict.fromkeys(DistributedMagics.magics["cell"], DistributedMagics))
    methods = {**SessionMagics.magics["line"], **DistributedMagics.magics["line"], **DistributedMagics.magics["cell"]}
    parts = []
    for magic, summary in MAGICS.items():
        name = magic.lstrip("%")
        method = methods.get(name)
        if method is None:
            raise RuntimeError(
                f"docs/hooks.py: {magic} is in sgpu_magic.front.magic_help.MAGICS but neither DistributedMagics "
                f"nor SessionMagics has a magic named {name!r}"
            )
        doc = getattr(classes[name], method).__doc__ or ""
        # the help's reST literal-block markers ("::" lines) say nothing on a web page
        doc = "\n".join(line for line in doc.splitlines() if line.strip() != "::")
        parts.append(f"## `{magic}`\n\n{html.escape(summary)}.\n\n{_block(doc)}")
    config = DistributedMagics.class_get_help()
    parts.append(
        "## `%config DistributedMagics`\n\nThe defaults shared by the magics and the decorator, as "
        "`%config DistributedMagics` lists them (set one with `%config DistributedMagics.timeout_s = "
        f"3600`).\n\n{_block(config)}"
    )
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, _magic_help_markdown())


def _role(match: re.Match) -> str:
    name = match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html_text: str, page, config, files) -> str:
    return ROLE.sub(_role, html_text)
