"""Speculative decoding's proposers: where the tokens a step verifies come from (issue 24)."""
