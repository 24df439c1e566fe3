"""A self-contained HTML report: one file, PNGs embedded as base64 data URIs, opens in any browser."""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path

from rdlm.fileio import write_text

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 2em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
.note { font-size: 0.85em; color: #444; } .prompt { font-family: monospace; white-space: pre-wrap; }
"""


@dataclass
class Figure:
    path: Path
    caption: str


@dataclass
class Section:
    title: str
    text: str = ""
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)


def embed_png(path: str | os.PathLike) -> str:
    data = Path(path).read_bytes()
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(name: str, rows: list[dict]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<details><summary>{html.escape(name)}</summary><table><tr>{head}</tr>{body}</table></details>"


def render(title: str, intro: str, sections: list[Section]) -> str:
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(intro)}</p>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        if section.text:
            parts.append(f"<p class='prompt'>{html.escape(section.text)}</p>")
        parts += [f"<p class='note'>{html.escape(n)}</p>" for n in section.notes]
        for fig in section.figures:
            parts.append(
                f"<figure><img alt='{html.escape(fig.path.name)}' src='{embed_png(fig.path)}'>"
                f"<figcaption>{html.escape(fig.caption)}</figcaption></figure>"
            )
        parts += [_table(name, rows) for name, rows in section.tables.items()]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(path: str | os.PathLike, title: str, intro: str, sections: list[Section]) -> Path:
    """Write the report atomically and return its path."""
    path = Path(path)
    return write_text(path, render(title, intro, sections))
