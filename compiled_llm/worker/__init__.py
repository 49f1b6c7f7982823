"""The worker: model runner, persistent input buffers, sampler."""
