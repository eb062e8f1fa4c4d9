"""The steps of the course the self-check knows: name -> module (FILE, WHAT, TODOS, check)."""

from __future__ import annotations

import importlib

ORDER = ("ddp", "sbatch", "fsdp", "tp", "pp", "perf", "perf-sbatch", "collectives", "memory")
MODULES = {"ddp": "ddp", "sbatch": "sbatch", "fsdp": "fsdp", "tp": "tp", "pp": "pp",
           "perf": "perf", "perf-sbatch": "perf_sbatch", "collectives": "collectives",
           "memory": "memory"}


def step(name: str):
    return importlib.import_module(f"selfcheck.steps.{MODULES[name]}")


def all_steps() -> dict:
    return {name: step(name) for name in ORDER}
