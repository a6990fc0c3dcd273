"""Markdown to the HTML subset QTextBrowser renders: fenced code, lists, headings, quotes, inline marks.

Written for streaming: any prefix of an answer renders sensibly (an unclosed fence is code so far).
"""
from __future__ import annotations

import html
import re

CODE_STYLE = ("background-color:#f1f3f5; color:#1f2328; font-family:'DejaVu Sans Mono',monospace; "
              "font-size:90%; padding:6px; margin:4px 0px")
INLINE_CODE_STYLE = "background-color:#eef0f2; font-family:'DejaVu Sans Mono',monospace"

_FENCE = re.compile(r"^\s{0,3}(```|~~~)\s*([\w+.#-]*)\s*$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_NUMBER = re.compile(r"^(\s*)(\d{1,9})[.)]\s+(.*)$")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_INLINE = re.compile(r"(`+)(.+?)\1|\*\*(.+?)\*\*|__(.+?)__|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?!\w)"
                     r"|(?<!\w)_(?!\s)(.+?)(?<!\s)_(?!\w)|\[([^\]]+)\]\(([^)\s]+)\)")


def inline(text: str) -> str:
    """Escape, then apply inline code, bold, italic and links (code spans are not parsed further)."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        code, bold, bold2, it, it2, label, url = m.group(2), m.group(3), m.group(4), m.group(5), m.group(6), \
            m.group(7), m.group(8)
        if code is not None:
            out.append(f'<code style="{INLINE_CODE_STYLE}">{html.escape(code.strip())}</code>')
        elif bold is not None or bold2 is not None:
            out.append(f"<b>{inline(bold if bold is not None else bold2)}</b>")
        elif it is not None or it2 is not None:
            out.append(f"<i>{inline(it if it is not None else it2)}</i>")
        else:
            out.append(f'<a href="{html.escape(url, quote=True)}">{inline(label)}</a>')
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def to_html(markdown: str) -> str:
    lines = markdown.replace("\r\n", "\n").split("\n")
    out: list[str] = []
    para: list[str] = []
    lists: list[tuple[str, int]] = []  # open list tags with their indentation
    i = 0

    def flush_para() -> None:
        if para:
            out.append("<p>" + "<br>".join(inline(p.strip()) for p in para) + "</p>")
            para.clear()

    def close_lists(indent: int = -1) -> None:
        while lists and lists[-1][1] > indent:
            out.append(f"</{lists.pop()[0]}>")

    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            flush_para()
            close_lists()
            marker, code = fence.group(1), []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                code.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of a still-streaming answer)
            lang = fence.group(2)
            label = f'<div style="color:#6a737d; font-size:80%">{html.escape(lang)}</div>' if lang else ""
            out.append(f'{label}<pre style="{CODE_STYLE}">{html.escape(chr(10).join(code))}</pre>')
            continue
        if not line.strip():
            flush_para()
            # a blank line inside a list does not end it unless the next line is not a list item
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not (_BULLET.match(nxt) or _NUMBER.match(nxt)):
                close_lists()
            i += 1
            continue
        heading, bullet, number = _HEADING.match(line), _BULLET.match(line), _NUMBER.match(line)
        if _RULE.match(line) and not (bullet and len(line.strip()) < 3):
            flush_para()
            close_lists()
            out.append("<hr>")
        elif heading:
            flush_para()
            close_lists()
            level = min(len(heading.group(1)) + 2, 6)  # answers' headings stay modest in a chat view
            out.append(f"<h{level}>{inline(heading.group(2))}</h{level}>")
        elif bullet or number:
            flush_para()
            indent = len((bullet or number).group(1).expandtabs(4))
            tag = "ul" if bullet else "ol"
            close_lists(indent)
            if not lists or lists[-1][1] < indent:
                start = f' start="{int(number.group(2))}"' if number and int(number.group(2)) != 1 else ""
                out.append(f"<{tag}{start}>")
                lists.append((tag, indent))
            elif lists[-1][0] != tag:
                out.append(f"</{lists.pop()[0]}><{tag}>")
                lists.append((tag, indent))
            out.append(f"<li>{inline(bullet.group(2) if bullet else number.group(3))}</li>")
        elif _QUOTE.match(line):
            flush_para()
            close_lists()
            quoted = []
            while i < len(lines) and _QUOTE.match(lines[i]):
                quoted.append(_QUOTE.match(lines[i]).group(1))
                i += 1
            out.append(f'<blockquote style="color:#57606a">{to_html(chr(10).join(quoted))}</blockquote>')
            continue
        elif lists and line.startswith((" ", "\t")):
            out[-1] = out[-1][:-5] + "<br>" + inline(line.strip()) + "</li>"  # a wrapped list item
        else:
            close_lists()
            para.append(line)
        i += 1
    flush_para()
    close_lists()
    return "\n".join(out)


def plain_to_html(text: str) -> str:
    """User messages: shown as typed (no Markdown), line breaks kept."""
    return "<p>" + html.escape(text).replace("\n", "<br>") + "</p>"
