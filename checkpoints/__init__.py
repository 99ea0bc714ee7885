"""Framework checkpoint and tensor-file readers/writers; each module imports its framework lazily."""
