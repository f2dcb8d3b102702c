"""The contract of one forward step, shared by every backend and the engine."""
