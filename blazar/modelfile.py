"""Ollama Modelfiles for `blazar create`: FROM, PARAMETER, ADAPTER, SYSTEM, TEMPLATE.

The result is a config overlay on the base model's blob: nothing is copied.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from blazar.errors import TeachingError

# Ollama PARAMETER -> (value type, llama-server flag). Flags are applied at spawn; sampling defaults
# are sent with each request by the text lane.
PARAMETERS: dict[str, tuple[type, str]] = {
    "num_ctx": (int, "--ctx-size"),
    "num_batch": (int, "--batch-size"),
    "num_thread": (int, "--threads"),
    "num_gpu": (int, "--n-gpu-layers"),
    "num_keep": (int, "--keep"),
    "num_predict": (int, "--n-predict"),
    "temperature": (float, "--temp"),
    "top_k": (int, "--top-k"),
    "top_p": (float, "--top-p"),
    "min_p": (float, "--min-p"),
    "typical_p": (float, "--typical"),
    "repeat_penalty": (float, "--repeat-penalty"),
    "repeat_last_n": (int, "--repeat-last-n"),
    "presence_penalty": (float, "--presence-penalty"),
    "frequency_penalty": (float, "--frequency-penalty"),
    "mirostat": (int, "--mirostat"),
    "mirostat_eta": (float, "--mirostat-lr"),
    "mirostat_tau": (float, "--mirostat-ent"),
    "seed": (int, "--seed"),
    "stop": (str, "--reverse-prompt"),
    "rpc": (str, "--rpc"),  # host:port,host:port: llama.cpp RPC workers (the text lane also offloads every layer)
}


class Modelfile(msgspec.Struct, kw_only=True):
    base: str
    parameters: dict[str, Any] = {}
    adapters: list[str] = []
    system: str | None = None
    template: str | None = None


class ModelfileError(TeachingError):
    """A Modelfile line Blazar cannot act on."""


_INSTRUCTION = re.compile(r"^\s*([A-Za-z]+)\s+(.*)$", re.DOTALL)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines, with triple-quoted values joined into one."""
    lines: list[tuple[int, str]] = []
    raw = text.splitlines()
    index = 0
    while index < len(raw):
        line = raw[index]
        start = index + 1
        if line.count('"""') == 1:
            block = [line]
            index += 1
            while index < len(raw) and '"""' not in raw[index]:
                block.append(raw[index])
                index += 1
            if index >= len(raw):
                raise ModelfileError(f"line {start}: a \"\"\" block is never closed", fix='close it with """')
            block.append(raw[index])
            line = "\n".join(block)
        lines.append((start, line))
        index += 1
    return lines


def _unquote(value: str) -> str:
    value = value.strip()
    for quote in ('"""', '"'):
        if value.startswith(quote) and value.endswith(quote) and len(value) >= 2 * len(quote):
            return value[len(quote):-len(quote)]
    return value


def parse(text: str) -> Modelfile:
    base = None
    parameters: dict[str, Any] = {}
    adapters: list[str] = []
    system = template = None
    for number, line in _logical_lines(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            raise ModelfileError(f"line {number}: cannot read {line.strip()[:60]!r}",
                                 fix="each line is INSTRUCTION value, e.g. PARAMETER num_ctx 4096")
        instruction, value = match.group(1).upper(), match.group(2).strip()
        if instruction == "FROM":
            base = _unquote(value)
        elif instruction == "PARAMETER":
            key, _, raw = value.partition(" ")
            key = key.strip().lower()
            if key not in PARAMETERS:
                raise ModelfileError(f"line {number}: unknown PARAMETER {key!r}",
                                     fix="accepted: " + ", ".join(sorted(PARAMETERS)))
            kind, _flag = PARAMETERS[key]
            try:
                converted = kind(_unquote(raw))
            except ValueError:
                raise ModelfileError(f"line {number}: PARAMETER {key} needs a {kind.__name__}, got {raw.strip()!r}",
                                     fix=f"e.g. PARAMETER {key} {'4096' if kind is int else '0.7'}") from None
            if key == "stop":
                parameters.setdefault("stop", []).append(converted)
            else:
                parameters[key] = converted
        elif instruction == "ADAPTER":
            adapters.append(_unquote(value))
        elif instruction == "SYSTEM":
            system = _unquote(value)
        elif instruction == "TEMPLATE":
            template = _unquote(value)
        elif instruction in ("LICENSE", "MESSAGE", "REQUIRES"):
            continue
        else:
            raise ModelfileError(f"line {number}: unknown instruction {instruction}",
                                 fix="use FROM, PARAMETER, ADAPTER, SYSTEM, TEMPLATE, LICENSE, MESSAGE")
    if not base:
        raise ModelfileError("the Modelfile has no FROM line", fix="add FROM <model or path to .gguf>")
    return Modelfile(base=base, parameters=parameters, adapters=adapters, system=system, template=template)


def server_flags(parameters: dict[str, Any]) -> list[str]:
    """llama-server arguments for a Modelfile's parameters."""
    flags: list[str] = []
    for key, value in parameters.items():
        flag = PARAMETERS[key][1]
        for item in value if isinstance(value, list) else [value]:
            flags += [flag, str(item)]
    return flags
