"""The frontend's side (process 0): `LLMEngine` and `AsyncLLM`, the clients of the engine core,
tokenization and chat templates, detokenization and stop strings, and metrics."""
