"""Drafters behind one contract (:mod:`draft_service.drafters.contract`): the model-free ones (ngram,
suffix) and the model drafters (llama_cpp, transformers_lm), whose proposals model_drafting.py
drafts as work of their engine loop."""
