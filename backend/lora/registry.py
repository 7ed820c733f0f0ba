"""The adapters a model may serve: ``multi_lora.json`` read and checked (no torch).

The file maps adapter names to PEFT adapter folders, as Triton's vllm_backend's does
(``{"sql": "adapters/sql-lora", ...}``); a value may also be ``{"path": ..., "task_id": N}`` to give
the adapter TensorRT-LLM's ``lora_task_id`` (otherwise adapters get 1, 2, ... in file order).
Relative paths resolve against the file's own folder. Requests name an adapter by name or task id,
and only ever through this table: a name is looked up, never joined to a path, so nothing outside
the folders listed here is ever opened because of a request.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
MAX_ADAPTERS = 4096


class LoRAConfigError(ValueError):
    """The adapter table or one of its entries is unusable; the message names it."""


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    name: str
    path: str  # absolute
    task_id: int


@dataclass(frozen=True, slots=True)
class AdapterRegistry:
    """Name -> entry, task id -> entry (both lookups only)."""

    by_name: dict[str, AdapterEntry]
    by_task_id: dict[int, AdapterEntry]

    @classmethod
    def empty(cls) -> AdapterRegistry:
        return cls({}, {})

    def resolve(self, name: str | None = None, task_id: int | None = None, where: str = "lora_name") -> str | None:
        """The adapter a request names (by name, or by TensorRT-LLM's task id), or None for the base
        model; LoRAConfigError naming the field for anything else."""
        if task_id is not None:
            entry = self.by_task_id.get(task_id)
            if entry is None:
                raise LoRAConfigError(f"lora_task_id: {task_id} is not an adapter of this model"
                                      f"{self._known('task ids', sorted(self.by_task_id))}")
            if name and name != entry.name:
                raise LoRAConfigError(f"lora_task_id: {task_id} is adapter {entry.name!r}, not {name!r} ({where})")
            return entry.name
        if not name:
            return None
        if not isinstance(name, str) or name not in self.by_name:
            shown = name if isinstance(name, str) and NAME.fullmatch(name) else "(not an adapter name)"
            raise LoRAConfigError(f"{where}: {shown!r} is not an adapter of this model"
                                  f"{self._known('names', sorted(self.by_name))}")
        return name

    @staticmethod
    def _known(kind: str, values: list) -> str:
        if not values:
            return " (it serves none)"
        shown = ", ".join(str(v) for v in values[:20])
        return f" (its {kind}: {shown}{', ...' if len(values) > 20 else ''})"


def read_registry(path: str) -> AdapterRegistry:
    """The adapters listed in ``path`` (multi_lora.json); LoRAConfigError naming the problem."""
    try:
        with open(path, encoding="utf-8") as handle:
            table = json.load(handle)
    except FileNotFoundError:
        raise LoRAConfigError(f"parameter 'lora_adapters': {path} does not exist") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAConfigError(f"parameter 'lora_adapters': {path} is not a readable JSON file ({exc})") from None
    if not isinstance(table, dict):
        raise LoRAConfigError(f"parameter 'lora_adapters': {path} must hold a JSON object of name -> folder")
    if len(table) > MAX_ADAPTERS:
        raise LoRAConfigError(f"parameter 'lora_adapters': at most {MAX_ADAPTERS} adapters, {path} lists {len(table)}")
    base = os.path.dirname(os.path.abspath(path))
    by_name: dict[str, AdapterEntry] = {}
    by_task_id: dict[int, AdapterEntry] = {}
    for index, (name, value) in enumerate(table.items(), start=1):
        where = f"{path}: adapter {name!r}"
        if not NAME.fullmatch(name):
            raise LoRAConfigError(f"{where}: a name is letters, digits, '.', '_' and '-' (at most 128), "
                                  "starting with a letter or digit")
        folder, task_id = (value, index) if isinstance(value, str) else _entry_object(where, value, index)
        entry = AdapterEntry(name, os.path.normpath(os.path.join(base, folder)), task_id)
        if task_id in by_task_id:
            raise LoRAConfigError(f"{where}: task_id {task_id} is also {by_task_id[task_id].name!r}'s")
        by_name[name] = by_task_id[task_id] = entry
    return AdapterRegistry(by_name, by_task_id)


def _entry_object(where: str, value, index: int) -> tuple[str, int]:
    if not isinstance(value, dict) or not isinstance(value.get("path"), str) or set(value) - {"path", "task_id"}:
        raise LoRAConfigError(f"{where}: expected a folder path, or {{\"path\": ..., \"task_id\": N}}")
    task_id = value.get("task_id", index)
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise LoRAConfigError(f"{where}: task_id must be an integer >= 0")
    return value["path"], task_id
