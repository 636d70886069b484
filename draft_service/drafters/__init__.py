"""Drafters behind one interface (:class:`draft_service.drafters.base.Drafter`)."""
