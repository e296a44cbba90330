"""Speculative decoding's proposers, run inside the engine's step (engine/runner/step.py): the draft
heads' chain (MTP, EAGLE-3: `proposer`), a separate draft model and prompt lookup (`drafter`, `ngram`),
the draft vocabulary's token map (`token_map`), and loading a head beside its target (`loading`). The
method and k are engine/config.py's SpecConfig; verification of the drafts is sampling's
(engine/sample/verify.py); the heads' modules are models (engine/models/).

Never imports Ray, cluster/, the engine loop (llm_engine, llm), masking or structured/.
"""
