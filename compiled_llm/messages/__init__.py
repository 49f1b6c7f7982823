"""Messages between the layers, in modules below all of them, so that imports point down only:
the frontend and the core exchange `engine_core`; the core hands the runner a `scheduler_output`
and gets a `runner_output` back."""
