"""OpenAI's wire protocol: request and response types, prompts and chat templates, logprobs, and the
parsers that turn a Qwen3 output into reasoning, content and tool calls. No HTTP, no engine loop."""
