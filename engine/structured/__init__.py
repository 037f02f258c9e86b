"""Structured output: what a request asks for, its compiled grammar, and the step's token mask.

spec.py holds StructuredSpec, the plain data a request carries (SamplingParams.structured),
checked when built and importable anywhere (the router and the workers build it from their
fields). grammar.py holds what the engine runs: a GrammarCache per engine compiles each
canonical spec once and gives every sequence its own matcher at admission; once per step the
engine asks it for the step's GrammarMask (the allowed-token bitmask of every sampling row whose
sequence has a grammar), which the sampler applies before anything else; the scheduler advances
a sequence's matcher by each token appended to it. The package __init__ imports nothing, so
importing the spec never loads the grammar library.
"""
