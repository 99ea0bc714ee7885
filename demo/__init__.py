"""The paired demo: its spec, its runners and the CPU stand-ins for Megatron-LM / MindFormers.

It makes runs (run stores) and then calls the same procedure as ``align report``."""
