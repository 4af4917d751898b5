"""PCM16 mono helpers the speech routes and the realtime session share: wrap raw samples in a WAV, and change
their rate (linear interpolation: the realtime API speaks 24 kHz, piper voices 16-22.05 kHz)."""

from __future__ import annotations

import io
import wave


def pcm_to_wav(pcm: bytes, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)
    return out.getvalue()


def resample(pcm: bytes, source_rate: int, target_rate: int = 24_000) -> bytes:
    if source_rate == target_rate or not pcm:
        return pcm
    import numpy as np

    samples = np.frombuffer(pcm[: len(pcm) - len(pcm) % 2], dtype=np.int16).astype(np.float32)
    count = round(len(samples) * target_rate / source_rate)
    positions = np.linspace(0, len(samples) - 1, num=count)
    return np.interp(positions, np.arange(len(samples)), samples).round().astype(np.int16).tobytes()
