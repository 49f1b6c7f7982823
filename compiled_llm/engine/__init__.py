"""The engine: frontend, engine core and its clients, scheduler, KV cache manager, detokenizer."""
