"""Speculative decoding: guess a few tokens, check them in one target step, keep what agrees.

The package is entered from two places. The scheduler asks the Speculator (speculator.py) for
each running sequence's guess budget when it starts a plan (`set_budgets`), so it can give a
checking sequence blocks and budget for 1 + k tokens. The engine step then calls it twice:
`propose` before the step executes (prompt lookup's, the draft model's or the EAGLE head's
guesses are written into the plan and the sampling rows rebuilt) and `observe` after the
scheduler applied the results (counters, the draft's KV position, the generators wound back, the
gate's timings; an EAGLE head runs over what the step kept). What a check keeps is verify.py's
rule, used by the scheduler's update. The other modules: config.py (the `speculative_config`
mapping, parsed once), gate.py (how many guesses a step checks), ngram.py (prompt lookup),
draft.py (the draft model and its KV) and eagle.py (EAGLE heads). The package
__init__ imports nothing, so engine/config.py can import config.py without the engine's
scheduler and runner.
"""
