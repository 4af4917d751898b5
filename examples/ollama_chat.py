"""The Ollama Python client against Blazar: it listens on Ollama's own port."""

import ollama

for part in ollama.chat(model="smollm2:135m", stream=True,
                        messages=[{"role": "user", "content": "Why is the sky blue?"}]):
    print(part.message.content, end="", flush=True)
print()
print([m.model for m in ollama.ps().models])
