"""Config and data checks (procedure stage 0 and the data checks)."""
