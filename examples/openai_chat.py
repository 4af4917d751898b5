"""Chat with Blazar through the official OpenAI SDK (start `blazar serve` first)."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:11434/v1", api_key="unused")
for chunk in client.chat.completions.create(
        model="smollm2:135m", stream=True, max_tokens=64,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}]):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# A forced tool call works even on a model whose template knows nothing about tools.
weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
answer = client.chat.completions.create(
    model="smollm2:135m", tools=[weather], tool_choice="required",
    messages=[{"role": "user", "content": "What's the weather in Paris?"}])
print(answer.choices[0].message.tool_calls[0].function)
