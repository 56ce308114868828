"""One row of results: a contender of a case, its parameters, its measurements and status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    case: str
    contender: str
    params: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # ok | skipped | failed
    note: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.result.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "contender": self.contender,
            "params": self.params,
            "status": self.status,
            "note": self.note,
            **self.result,
        }
