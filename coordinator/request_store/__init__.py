"""The request store (Redis or in-process) and the checks of a resume from it."""
