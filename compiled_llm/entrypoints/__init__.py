"""How users reach the engine: the CLI, the OpenAI-compatible server and the offline `LLM`."""
