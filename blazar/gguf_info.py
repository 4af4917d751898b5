"""What a GGUF file says about itself, read with the `gguf` package (blocking)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, LlamaFileType


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:
        return None


def read_info(path: Path) -> dict[str, Any]:
    reader = GGUFReader(str(path), "r")
    arch = _field(reader, "general.architecture") or "unknown"
    file_type = _field(reader, "general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = None
    if quant is None and reader.tensors:
        counts: dict[str, int] = {}
        for tensor in reader.tensors:
            name = GGMLQuantizationType(tensor.tensor_type).name
            counts[name] = counts.get(name, 0) + int(tensor.n_elements)
        quant = max(counts, key=counts.__getitem__)
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    tensor_names = {t.name for t in reader.tensors}
    pooling = _field(reader, f"{arch}.pooling_type")
    has_rank_head = ("cls.output.weight" in tensor_names
                     or _field(reader, f"{arch}.classifier.output_labels") is not None)
    template = _field(reader, "tokenizer.chat_template")
    return {
        "architecture": arch,
        "name": _field(reader, "general.name"),
        "parameters": parameters,
        "parameters_human": _human(parameters),
        "quantization": quant,
        "context_length": _field(reader, f"{arch}.context_length"),
        "embedding_length": _field(reader, f"{arch}.embedding_length"),
        "block_count": _field(reader, f"{arch}.block_count"),
        "head_count": _field(reader, f"{arch}.attention.head_count"),
        "head_count_kv": _field(reader, f"{arch}.attention.head_count_kv"),
        "chat_template": template is not None,
        "embedding_head": pooling is not None and int(pooling) != 0,
        "rank_head": bool(has_rank_head),
        "tensors": len(reader.tensors),
    }


def kv_cache_bytes(info: dict[str, Any], context: int, bytes_per_value: float = 2.0) -> int:
    """K and V for `context` tokens at f16: 2 * layers * ctx * (embd / heads * kv_heads) * 2 bytes."""
    layers = info.get("block_count") or 0
    embd = info.get("embedding_length") or 0
    heads = info.get("head_count") or 1
    kv_heads = info.get("head_count_kv") or heads
    return int(2 * layers * context * (embd / heads * kv_heads) * bytes_per_value)


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}".replace(".0", "")
    return str(count)


class HeaderTruncated(Exception):
    """The bytes end before the metadata does: fetch more."""


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def parse_header(data: bytes) -> dict[str, Any]:
    """The metadata key/values of a GGUF from its first bytes (for sizing a file before download)."""
    import struct

    position = 0

    def take(fmt: str) -> Any:
        nonlocal position
        size = struct.calcsize(fmt)
        if position + size > len(data):
            raise HeaderTruncated
        (value,) = struct.unpack_from(fmt, data, position)
        position += size
        return value

    def text() -> str:
        nonlocal position
        length = take("<Q")
        if position + length > len(data):
            raise HeaderTruncated
        value = data[position:position + length].decode("utf-8", errors="replace")
        position += length
        return value

    def value(kind: int) -> Any:
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return text()
        if kind == 9:
            item_kind, count = take("<I"), take("<Q")
            items = [value(item_kind) for _ in range(count)]
            return items if count <= 16 else f"<array of {count}>"
        raise ValueError(f"unknown GGUF value type {kind}")

    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    position = 4
    take("<I")  # version
    take("<Q")  # tensor count
    count = take("<Q")
    return {text(): value(take("<I")) for _ in range(count)}


def info_from_header(metadata: dict[str, Any]) -> dict[str, Any]:
    arch = metadata.get("general.architecture", "unknown")
    return {
        "architecture": arch,
        "name": metadata.get("general.name"),
        "context_length": metadata.get(f"{arch}.context_length"),
        "embedding_length": metadata.get(f"{arch}.embedding_length"),
        "block_count": metadata.get(f"{arch}.block_count"),
        "head_count": metadata.get(f"{arch}.attention.head_count"),
        "head_count_kv": metadata.get(f"{arch}.attention.head_count_kv"),
        "chat_template": "tokenizer.chat_template" in metadata,
    }
