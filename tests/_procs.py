"""Find processes that carry a marker in their environment (for the no-orphans checks)."""

from __future__ import annotations

import os


def processes_with_env(marker: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment contains ``marker``."""
    found = []
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle not in fh.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append(int(name))
    return found
