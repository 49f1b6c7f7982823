"""Structured outputs in the engine core: a request's output held to a JSON schema, any JSON
object, a regular expression, a list of choices or an EBNF grammar, by xgrammar.

The frontend validates a request's constraint (`structured_output_spec.validate_structured_outputs`,
parsing only). The engine core compiles each distinct constraint once, in a thread off its step loop
(`GrammarCompilerPool`), keeps a request out of the scheduler until its grammar is ready, gives it
a matcher (`RequestGrammar`) that every accepted token advances, and before each sampling fills
one bitmask row per constrained request (`fill_grammar_bitmask`), which the model runner applies
to the logits after the compiled forward.
"""

from compiled_llm.core.structured_outputs.compiler import GrammarCompilerPool
from compiled_llm.core.structured_outputs.grammar import RequestGrammar, fill_grammar_bitmask

__all__ = ["GrammarCompilerPool", "RequestGrammar", "fill_grammar_bitmask"]
