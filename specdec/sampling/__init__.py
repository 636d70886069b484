"""Sampling: a request's parameters, the logits -> probabilities transform and seeded draws both
sides share, the acceptance test, logits processors, log-probabilities, and structured output's
grammar masks."""
