"""Facts about this machine that planning and doctor both read (blocking: call through a thread)."""

from __future__ import annotations


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                number = rest.strip().split()[0]
                values[name] = int(number) * 1024
    except OSError:
        pass
    return values
