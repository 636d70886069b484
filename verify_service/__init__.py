"""The verify service: hosts the target model, verifies proposals, runs plain decode steps."""
