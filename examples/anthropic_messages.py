"""The Anthropic SDK against Blazar (start `blazar serve` first)."""

import anthropic

client = anthropic.Anthropic(base_url="http://127.0.0.1:11434", api_key="unused")
with client.messages.stream(model="smollm2:135m", max_tokens=64,
                            messages=[{"role": "user", "content": "Name three rivers."}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
print(client.messages.count_tokens(model="smollm2:135m", messages=[{"role": "user", "content": "Hi"}]))
