"""The compile worker's fork server lowers its own CPU priority before it imports anything heavy.

Imported by that fork server alone, first of its preload list (compile_worker._PRELOAD), never by
the engine: importing it lowers the priority of the process that imports it. Why: the fork server's
first start imports xgrammar and torch, seconds of CPU that an engine start, and a model's recovery
after its stub died, spend beside it; at the worker's priority that import takes what the engine
core's start and first steps leave, as the compiles do. The workers it forks inherit the priority.
"""

from __future__ import annotations

from backend.structured_output.compile_worker import lower_priority

lower_priority()
