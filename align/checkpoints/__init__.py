"""Framework checkpoint readers and writers (frameworks imported lazily, inside the functions that need them)."""
