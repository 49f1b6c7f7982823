"""Model implementations written for this engine, and the loader that fills them."""
