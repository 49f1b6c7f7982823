"""Building blocks of the models: one layer kind a file."""
