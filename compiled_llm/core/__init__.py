"""The engine core's side (process 1): the scheduler, the KV-cache manager and block pool, each
request's state, and the busy loop that steps them around the model runner (`worker/`)."""
