"""Framework checkpoint readers/writers (frameworks imported lazily inside the functions)."""
