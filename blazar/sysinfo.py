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


def gpu_memory_by_pid(pids: set[int]) -> dict[int, int]:
    """Bytes of GPU memory each of `pids` holds, from NVML; {} without an NVIDIA driver."""
    if not pids:
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: nothing is on a GPU
        return {}
    used: dict[int, int] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in pids and process.usedGpuMemory:
                    used[process.pid] = used.get(process.pid, 0) + int(process.usedGpuMemory)
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()
    return used
