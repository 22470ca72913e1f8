"""The driver side: turns a JobSpec into a Ray Train run (imports ray, never torch)."""
