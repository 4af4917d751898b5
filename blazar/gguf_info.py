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
        quant = max(counts, key=counts.get)
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    tensor_names = {t.name for t in reader.tensors}
    pooling = _field(reader, f"{arch}.pooling_type")
    has_rank_head = "cls.output.weight" in tensor_names or _field(reader, f"{arch}.classifier.output_labels") is not None
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
