"""Saved conversations: one JSON file each, written atomically, a corrupt file set aside and never fatal."""
from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from staticlm.apps.home import home

FORMAT = "staticlm-conversation"
VERSION = 1


def conversations_dir() -> Path:
    return home() / "conversations"


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3))
    title: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    system_prompt: str | None = None
    messages: list[dict] = field(default_factory=list)  # [{"role": ..., "content": ...}]

    @property
    def display_title(self) -> str:
        if self.title:
            return self.title
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        first = " ".join(first.split())
        return (first[:48] + "…") if len(first) > 48 else (first or "New chat")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "id": self.id, "title": self.title, "created": self.created,
                "updated": self.updated, "system_prompt": self.system_prompt, "messages": self.messages}

    @classmethod
    def from_dict(cls, d: dict) -> Conversation:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a staticlm conversation")
        messages = d.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages are malformed")
        return cls(id=str(d["id"]), title=str(d.get("title") or ""), created=float(d.get("created", 0.0)),
                   updated=float(d.get("updated", 0.0)), system_prompt=d.get("system_prompt"),
                   messages=[{"role": m["role"], "content": m["content"]} for m in messages])


def atomic_write_text(path: Path, text: str) -> None:
    """tmp file in the same directory, fsync, os.replace: a crash leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class ConversationStore:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else conversations_dir()
        self.warnings: list[str] = []  # problems met since the last take_warnings()

    def path_of(self, conv_id: str) -> Path:
        safe = "".join(c for c in conv_id if c.isalnum() or c in "-_")
        if not safe:
            raise ValueError(f"bad conversation id {conv_id!r}")
        return self.directory / f"{safe}.json"

    def take_warnings(self) -> list[str]:
        out, self.warnings = self.warnings, []
        return out

    def _set_aside(self, path: Path, why: str) -> None:
        target = path.with_name(path.name + ".corrupt")
        n = 1
        while target.exists():
            target = path.with_name(f"{path.name}.{n}.corrupt")
            n += 1
        try:
            os.replace(path, target)
            where = f"moved to {target.name}"
        except OSError as e:
            where = f"could not be moved aside ({e.strerror or e})"
        self.warnings.append(f"Conversation file {path.name} is unreadable ({why}); {where}.")

    def _read(self, path: Path) -> Conversation | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            conv = Conversation.from_dict(data)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
            self._set_aside(path, type(e).__name__ if not str(e) else str(e).splitlines()[0][:80])
            return None
        if path.stem != conv.id:
            conv.id = path.stem  # the file name is the identity
        return conv

    def list(self) -> list[Conversation]:
        """Every readable conversation, newest first; unreadable files are set aside with a warning."""
        if not self.directory.is_dir():
            return []
        out = []
        for path in sorted(self.directory.glob("*.json")):
            conv = self._read(path)
            if conv is not None:
                out.append(conv)
        out.sort(key=lambda c: c.updated, reverse=True)
        return out

    def load(self, conv_id: str) -> Conversation | None:
        return self._read(self.path_of(conv_id))

    def save(self, conv: Conversation) -> Path:
        conv.updated = time.time()
        path = self.path_of(conv.id)
        atomic_write_text(path, json.dumps(conv.to_dict(), ensure_ascii=False, indent=1))
        return path

    def delete(self, conv_id: str) -> bool:
        try:
            self.path_of(conv_id).unlink()
            return True
        except FileNotFoundError:
            return False
