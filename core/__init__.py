"""The foundation: errors, findings, the run store, runs, name mapping and its presets. Imports nothing above it."""
