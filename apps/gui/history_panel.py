"""The side panel: saved conversations, newest first, with New chat and Delete."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton, QVBoxLayout, QWidget

from .history import Conversation


class HistoryPanel(QWidget):
    opened = Signal(str)  # a conversation id
    new_requested = Signal()
    delete_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.list = QListWidget()
        self.list.itemActivated.connect(self._open)
        self.list.itemClicked.connect(self._open)
        self.new_button, self.delete_button = QPushButton("New chat"), QPushButton("Delete")
        self.new_button.clicked.connect(self.new_requested)
        self.delete_button.clicked.connect(self._delete)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(QLabel("<b>Conversations</b>"))
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        row.addWidget(self.new_button)
        row.addWidget(self.delete_button)
        layout.addLayout(row)

    def show_conversations(self, conversations: list[Conversation], *, current_id: str) -> None:
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.display_title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(f"{len(conv.messages)} messages · {conv.id}")
            self.list.addItem(item)
            if conv.id == current_id:
                self.list.setCurrentItem(item)

    def ids(self) -> list[str]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]

    def _open(self, item: QListWidgetItem) -> None:
        self.opened.emit(item.data(Qt.ItemDataRole.UserRole))

    def _delete(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.delete_requested.emit(item.data(Qt.ItemDataRole.UserRole))
